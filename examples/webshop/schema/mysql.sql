-- The shop's own tables (its migrations create them) and the triggers that queue an
-- event row for every order placed or changed.
CREATE TABLE webshop_orders (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    customer VARCHAR(255) NOT NULL,
    status VARCHAR(32) NOT NULL
);

-- Row mode: every row runs on_order_event(order_id, kind); one order's events in order.
CREATE TABLE webshop_order_events (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    order_id BIGINT NOT NULL,
    kind VARCHAR(32) NOT NULL,
    attempt INT NOT NULL DEFAULT 0,
    locked_until DATETIME(6) NULL,
    available_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    INDEX webshop_order_events_claim (available_at, id),
    INDEX webshop_order_events_group (order_id, id)
);

CREATE TRIGGER webshop_order_placed AFTER INSERT ON webshop_orders FOR EACH ROW
    INSERT INTO webshop_order_events (order_id, kind) VALUES (NEW.id, NEW.status);
CREATE TRIGGER webshop_order_changed AFTER UPDATE ON webshop_orders FOR EACH ROW
    INSERT INTO webshop_order_events (order_id, kind)
    SELECT NEW.id, NEW.status FROM DUAL WHERE NOT (OLD.status <=> NEW.status);

-- Row mode: any task by name, its keyword arguments as a JSON object.
CREATE TABLE webshop_jobs (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    task VARCHAR(255) NULL,
    payload LONGTEXT NOT NULL,
    attempt INT NOT NULL DEFAULT 0,
    locked_until DATETIME(6) NULL,
    available_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))
);

-- Plain rows: mail the mailer service sends; "source" only the publish statement fills.
CREATE TABLE webshop_mail (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    kind VARCHAR(255) NOT NULL,
    body LONGTEXT NOT NULL,
    source VARCHAR(255) NOT NULL,
    attempt INT NOT NULL DEFAULT 0,
    locked_until DATETIME(6) NULL,
    available_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))
);
