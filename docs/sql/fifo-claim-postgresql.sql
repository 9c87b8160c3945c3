-- claim on a table with a FIFO group (examples/crm): only a group's head qualifies,
-- looked for among the first :window ready rows (:limit + 16); rows below the claim
-- floor (:floor, see Performance) are passed over in the index
UPDATE "crm_outbound" AS q
SET "locked_until" = now() + make_interval(secs => :lease),
    "attempt" = q."attempt" + 1
WHERE q."id" = ANY(ARRAY(SELECT r."id" FROM "crm_outbound" AS r
      JOIN unnest(ARRAY(SELECT w."id" FROM (SELECT w."id" FROM "crm_outbound" AS w
                                            WHERE (w."locked_until" IS NULL OR w."locked_until" < now())
                                              AND w."available_at" <= now()
                                              AND w."available_at" >= to_timestamp(CAST(:floor AS double precision))
                                            ORDER BY w."available_at", w."id"
                                            LIMIT :window) AS w)) AS h (id) ON r."id" = h.id
      WHERE (r."locked_until" IS NULL OR r."locked_until" < now())
        AND r."available_at" <= now()
        AND (r."target" IS NULL
             OR r."id" = (SELECT ahead."id" FROM "crm_outbound" AS ahead
                          WHERE ahead."target" = r."target"
                          ORDER BY ahead."target", ahead."id" LIMIT 1))
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
      ORDER BY r."available_at", r."id"
      LIMIT :limit
      FOR UPDATE OF r SKIP LOCKED))
RETURNING q."id" AS "id", q."attempt" AS "attempt", q."payload" AS "payload",
          q."headers" AS "headers", q."target" AS "group",
          q."available_at" AS "available_at";

-- publish: the row and its NOTIFY in one statement
WITH published AS (INSERT INTO "crm_outbound" ("payload", "headers", "available_at",
                                              "target")
                   VALUES (:payload, :headers, COALESCE(to_timestamp(:eta), now()), :group)
                   RETURNING 1)
SELECT pg_notify(:channel, '') WHERE EXISTS (SELECT 1 FROM published);

-- retry_after: in place, hidden until due
UPDATE "crm_outbound"
SET "locked_until" = NULL, "available_at" = now() + make_interval(secs => :delay)
WHERE "attempt" = :attempt AND "id" IN :ids;

-- the same claim, same transaction, when the window held fewer than :limit heads: every
-- group's head by a loose index scan of (target, id), one step per group
UPDATE "crm_outbound" AS q
SET "locked_until" = now() + make_interval(secs => :lease),
    "attempt" = q."attempt" + 1
WHERE q."id" = ANY(ARRAY(SELECT r."id" FROM "crm_outbound" AS r
      JOIN unnest(ARRAY(SELECT h.id
          FROM (WITH RECURSIVE g (g) AS (SELECT MIN(x."target") FROM "crm_outbound" AS x
            UNION ALL
            SELECT (SELECT x."target" FROM "crm_outbound" AS x WHERE x."target" > g.g
                    ORDER BY x."target" LIMIT 1)
            FROM g WHERE g.g IS NOT NULL)
          SELECT (SELECT x."id" FROM "crm_outbound" AS x WHERE x."target" = g.g
                  ORDER BY x."target", x."id" LIMIT 1) AS id
          FROM g WHERE g.g IS NOT NULL
          UNION ALL
          SELECT * FROM (SELECT r."id" FROM "crm_outbound" AS r
                         WHERE r."target" IS NULL
                           AND (r."locked_until" IS NULL OR r."locked_until" < now())
                           AND r."available_at" <= now()
                         ORDER BY r."target", r."id" LIMIT :limit) AS n) AS h)) AS h (id)
        ON r."id" = h.id
      WHERE (r."locked_until" IS NULL OR r."locked_until" < now()) AND r."available_at" <= now()
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
      ORDER BY r."available_at", r."id" LIMIT :limit FOR UPDATE OF r SKIP LOCKED))
RETURNING q."id" AS "id", q."attempt" AS "attempt", q."payload" AS "payload", q."headers" AS "headers",
          q."target" AS "group", q."available_at" AS "available_at";
