"""Benchmark kombu-sqlinbox: every section, one Markdown table each, then the targets.

    python bench/run.py [--sections core,publish,latency,ordering,transactional,outbox,
                                    layout,remote,scale,consumers,publishers,mvcc,
                                    pgq,retention,chord_counts,dashboard]
                        [--quick [SECTIONS]] [--databases postgresql,mysql,sqlite]
                        [--json PATH] [section options: see --help]

Sections: ``core`` (publish, consume, latency, racers, Celery end to end against a raw
driver loop, kombu sqla, Redis and RabbitMQ), ``publish`` (one message per commit against
the raw driver loop and memory://, a bound bulk publish against a multi-row INSERT,
Celery's apply_async against Producer.publish), ``ordering`` (FIFO groups, partition keys,
NOTIFY latency), ``transactional`` (transactional vs plain tasks/s), ``outbox``
(apply_async overhead, republish rate), ``layout`` (a reply queue's life in the shared
transient table and in a table of its own), ``remote`` (``celery inspect ping`` round
trip, event delivery and heartbeats against Redis and RabbitMQ), ``latency`` (idle
publish -> receive on each database against Redis, Redis ``appendfsync always`` and
RabbitMQ; the PostgreSQL breakdown; what an idle consumer costs), ``scale`` (claim time,
drain rates and worker memory against the backlog's size), ``consumers`` (1 to 16
consumer processes on a million waiting rows: rate, claim times, lock waits, memory),
``publishers`` (1 to 64 publishing threads and processes against RabbitMQ with confirms),
``mvcc`` (a queue under steady load beside a snapshot held open: ten minutes a database
and mode), ``pgq`` (PgQ under the same load, with the mvcc options: the anchor),
``retention`` (``backend_cleanup`` deleting a million expired results while results are
written), ``chord_counts`` (one header task's count early and late in a chord of 5,000),
``dashboard`` (every dashboard page's p50 / p95 with 1,000,000 waiting rows and 100,000
dead letters). Each section module also runs alone: ``python bench/ordering.py --help``.
Not a test: the figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the bench package, not its modules

from bench import (  # noqa: E402
    chord_counts,
    consume,
    consumers,
    core,
    dashboard,
    latency,
    layout,
    mvcc,
    ordering,
    outbox,
    pgq,
    publish,
    publishers,
    remote,
    retention,
    scale,
    transactional,
)
from bench.cli import main  # noqa: E402

SECTIONS = [core.SECTION, consume.SECTION, publish.SECTION, publishers.SECTION, latency.SECTION,
            ordering.SECTION, transactional.SECTION, outbox.SECTION, layout.SECTION, remote.SECTION,
            scale.SECTION, consumers.SECTION, mvcc.SECTION, pgq.SECTION, retention.SECTION,
            chord_counts.SECTION, dashboard.SECTION]

if __name__ == "__main__":
    sys.exit(main(SECTIONS, sys.argv[1:], (__doc__ or "").splitlines()[0]))
