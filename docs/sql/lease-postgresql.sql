-- claim: lease up to :limit ready rows, in claim order, in one statement; one index
-- range per band of priorities (above, at and below 0), each starting at the floor;
-- the rows picked are locked, then leased where they lie (the tuple ids, ctid, of the
-- versions locked), so the lease never depends on the table's statistics
UPDATE "sqlinbox_celery" AS q
SET "locked_until" = now() + make_interval(secs => :lease),
    "attempt" = q."attempt" + 1
WHERE q.ctid = ANY(ARRAY(SELECT b.c0 AS "id"
      FROM ((SELECT * FROM (SELECT r.ctid AS c0, r."priority" AS p, r."available_at" AS a,
                                   r."id" AS i
        FROM "sqlinbox_celery" AS r WHERE r."priority" > 0
        AND (r."locked_until" IS NULL OR r."locked_until" < now()) AND r."available_at" <= now()
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
        ORDER BY r."priority" DESC, r."available_at", r."id" LIMIT :limit FOR UPDATE OF r SKIP LOCKED) AS b)
      UNION ALL
      (SELECT * FROM (SELECT r.ctid AS c0, r."priority" AS p, r."available_at" AS a,
                             r."id" AS i
        FROM "sqlinbox_celery" AS r WHERE r."priority" = 0
        AND (r."locked_until" IS NULL OR r."locked_until" < now()) AND r."available_at" <= now()
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
        ORDER BY r."priority" DESC, r."available_at", r."id" LIMIT :limit FOR UPDATE OF r SKIP LOCKED) AS b)
      UNION ALL
      (SELECT * FROM (SELECT r.ctid AS c0, r."priority" AS p, r."available_at" AS a,
                             r."id" AS i
        FROM "sqlinbox_celery" AS r WHERE r."priority" < 0
        AND (r."locked_until" IS NULL OR r."locked_until" < now()) AND r."available_at" <= now()
        AND r."available_at" >= to_timestamp(CAST(:floor AS double precision))
        ORDER BY r."priority" DESC, r."available_at", r."id" LIMIT :limit FOR UPDATE OF r SKIP LOCKED) AS b)) AS b
      ORDER BY b.p DESC, b.a, b.i
      LIMIT :limit))
RETURNING q."id" AS "id", q."attempt" AS "attempt", q."payload" AS "payload",
          q."headers" AS "headers", q."priority" AS "priority",
          q."available_at" AS "available_at";

-- extend: the lease keeper, once per attempt value among the rows held (a row already
-- given back has no lease, and is not leased again)
UPDATE "sqlinbox_celery"
SET "locked_until" = now() + make_interval(secs => :lease)
WHERE "attempt" = :attempt AND "id" IN :ids AND "locked_until" IS NOT NULL;

-- ack: delete the rows (fenced the same way), found through the primary key in id order
-- (the order asked for makes that walk the planner's pick) and deleted where their locked
-- versions lie; a row the lease keeper extended while the ack waited for its lock is
-- locked in a version this statement's snapshot does not show, so for rows it missed the
-- ack runs once more as DELETE ... WHERE "attempt" = :attempt AND "id" IN :ids
DELETE FROM "sqlinbox_celery"
WHERE ctid = ANY(ARRAY(SELECT r.ctid FROM "sqlinbox_celery" AS r
                       WHERE "attempt" = :attempt AND "id" IN :ids
                       ORDER BY r."id" FOR UPDATE));

-- requeue: back in place, the attempt stays counted
UPDATE "sqlinbox_celery" SET "locked_until" = NULL
WHERE "attempt" = :attempt AND "id" IN :ids;
