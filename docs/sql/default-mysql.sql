CREATE TABLE IF NOT EXISTS `sqlinbox_celery` (
    `id` BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    `payload` LONGBLOB NOT NULL,
    `headers` LONGTEXT,
    `priority` SMALLINT NOT NULL DEFAULT 0,
    `available_at` DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    `locked_until` DATETIME(6) NULL,
    `attempt` INT NOT NULL DEFAULT 0,
    INDEX `sqlinbox_celery_claim` (`priority` DESC, `available_at`, `id`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
