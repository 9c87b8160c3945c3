-- claim on a table with a FIFO group (examples/crm): only a group's head qualifies;
-- rows below the claim floor (:floor, see Performance) are passed over in the index
UPDATE "crm_outbound" AS q
SET "locked_until" = now() + make_interval(secs => :lease),
    "attempt" = q."attempt" + 1
FROM (SELECT r."id" FROM "crm_outbound" AS r
      WHERE (r."locked_until" IS NULL OR r."locked_until" < now())
        AND r."available_at" <= now()
        AND NOT EXISTS (SELECT 1 FROM "crm_outbound" AS ahead
                        WHERE ahead."target" = r."target" AND ahead."id" < r."id")
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
      ORDER BY r."available_at", r."id"
      LIMIT :limit
      FOR UPDATE OF r SKIP LOCKED) AS c
WHERE q."id" = c."id"
RETURNING q."id" AS "id", q."attempt" AS "attempt", q."payload" AS "payload",
          q."headers" AS "headers", q."target" AS "group",
          q."available_at" AS "available_at";

-- publish: the row and its NOTIFY in one statement
WITH published AS (INSERT INTO "crm_outbound" ("payload", "headers", "available_at",
                                              "target")
                   VALUES (:payload, :headers, COALESCE(to_timestamp(:eta), now()), :group)
                   RETURNING 1)
SELECT pg_notify(:channel, '') FROM published;

-- retry_after: in place, hidden until due
UPDATE "crm_outbound"
SET "locked_until" = NULL, "available_at" = now() + make_interval(secs => :delay)
WHERE "attempt" = :attempt AND "id" IN :ids;
