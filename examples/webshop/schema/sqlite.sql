-- The shop's own tables (its migrations create them) and the triggers that queue an
-- event row for every order placed or changed. Times are epoch seconds.
CREATE TABLE webshop_orders (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    customer TEXT NOT NULL,
    status TEXT NOT NULL
);

-- Row mode: every row runs on_order_event(order_id, kind); one order's events in order.
CREATE TABLE webshop_order_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id INTEGER NOT NULL,
    kind TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    locked_until REAL,
    available_at REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0)
);
CREATE INDEX webshop_order_events_claim ON webshop_order_events (available_at, id);
CREATE INDEX webshop_order_events_group ON webshop_order_events (order_id, id);

CREATE TRIGGER webshop_order_placed AFTER INSERT ON webshop_orders BEGIN
    INSERT INTO webshop_order_events (order_id, kind) VALUES (NEW.id, NEW.status);
END;
CREATE TRIGGER webshop_order_changed AFTER UPDATE OF status ON webshop_orders
    WHEN OLD.status IS NOT NEW.status BEGIN
    INSERT INTO webshop_order_events (order_id, kind) VALUES (NEW.id, NEW.status);
END;

-- Row mode: any task by name, its keyword arguments as a JSON object.
CREATE TABLE webshop_jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task TEXT,
    payload TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    locked_until REAL,
    available_at REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0)
);

-- Plain rows: mail the mailer service sends; "source" only the publish statement fills.
CREATE TABLE webshop_mail (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    source TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    locked_until REAL,
    available_at REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0)
);
