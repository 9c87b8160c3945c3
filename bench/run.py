"""Benchmark kombu-sqlinbox: every section, one Markdown table each, then the targets.

    python bench/run.py [--sections core,publish,latency,ordering,transactional,outbox,
                                    layout,remote,scale,mvcc,retention]
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
drain rates and worker memory against the backlog's size), ``mvcc`` (a queue under steady
load beside a snapshot held open: ten minutes a database), ``retention`` (``backend_cleanup``
deleting a million expired results while results are written). Each section module
also runs alone: ``python bench/ordering.py --help``.
Not a test: the figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the bench package, not its modules

from bench import (  # noqa: E402
    consume,
    core,
    latency,
    layout,
    mvcc,
    ordering,
    outbox,
    publish,
    remote,
    retention,
    scale,
    transactional,
)
from bench.cli import main  # noqa: E402

SECTIONS = [core.SECTION, consume.SECTION, publish.SECTION, latency.SECTION, ordering.SECTION,
            transactional.SECTION, outbox.SECTION, layout.SECTION, remote.SECTION,
            scale.SECTION, mvcc.SECTION, retention.SECTION]

if __name__ == "__main__":
    sys.exit(main(SECTIONS, sys.argv[1:], (__doc__ or "").splitlines()[0]))
