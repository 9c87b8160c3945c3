CREATE TABLE IF NOT EXISTS "sqlinbox_celery" (
    "id" INTEGER PRIMARY KEY AUTOINCREMENT,
    "payload" BLOB NOT NULL,
    "headers" TEXT,
    "priority" INTEGER NOT NULL DEFAULT 0,
    "available_at" REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0),
    "locked_until" REAL,
    "attempt" INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS "sqlinbox_celery_claim" ON "sqlinbox_celery" ("priority" DESC, "available_at", "id");
