-- claim: lease up to :limit ready rows, in claim order, in one statement; one index
-- range per band of priorities (above, at and below 0), each starting at the floor
UPDATE "sqlinbox_celery" AS q
SET "locked_until" = now() + make_interval(secs => :lease),
    "attempt" = q."attempt" + 1
FROM (SELECT b.c0 AS "id"
      FROM ((SELECT * FROM (SELECT r."id" AS c0, r."priority" AS p, r."available_at" AS a
        FROM "sqlinbox_celery" AS r WHERE r."priority" > 0
        AND (r."locked_until" IS NULL OR r."locked_until" < now()) AND r."available_at" <= now()
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
        ORDER BY r."priority" DESC, r."available_at", r."id" LIMIT :limit FOR UPDATE OF r SKIP LOCKED) AS b)
      UNION ALL
      (SELECT * FROM (SELECT r."id" AS c0, r."priority" AS p, r."available_at" AS a
        FROM "sqlinbox_celery" AS r WHERE r."priority" = 0
        AND (r."locked_until" IS NULL OR r."locked_until" < now()) AND r."available_at" <= now()
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
        ORDER BY r."priority" DESC, r."available_at", r."id" LIMIT :limit FOR UPDATE OF r SKIP LOCKED) AS b)
      UNION ALL
      (SELECT * FROM (SELECT r."id" AS c0, r."priority" AS p, r."available_at" AS a
        FROM "sqlinbox_celery" AS r WHERE r."priority" < 0
        AND (r."locked_until" IS NULL OR r."locked_until" < now()) AND r."available_at" <= now()
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
        ORDER BY r."priority" DESC, r."available_at", r."id" LIMIT :limit FOR UPDATE OF r SKIP LOCKED) AS b)) AS b
      ORDER BY b.p DESC, b.a, b.c0
      LIMIT :limit) AS c
WHERE q."id" = c."id"
RETURNING q."id" AS "id", q."attempt" AS "attempt", q."payload" AS "payload",
          q."headers" AS "headers", q."priority" AS "priority",
          q."available_at" AS "available_at";

-- extend: the lease keeper, once per attempt value among the rows held (a row already
-- given back has no lease, and is not leased again)
UPDATE "sqlinbox_celery"
SET "locked_until" = now() + make_interval(secs => :lease)
WHERE "attempt" = :attempt AND "id" IN :ids AND "locked_until" IS NOT NULL;

-- ack: delete the rows (fenced the same way)
DELETE FROM "sqlinbox_celery" WHERE "attempt" = :attempt AND "id" IN :ids;

-- requeue: back in place, the attempt stays counted
UPDATE "sqlinbox_celery" SET "locked_until" = NULL
WHERE "attempt" = :attempt AND "id" IN :ids;
