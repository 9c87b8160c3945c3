"""Benchmark kombu-sqlinbox: every section, one Markdown table each, then the targets.

    python bench/run.py [--sections core,ordering,transactional,outbox,layout,remote,scale]
                        [--quick [SECTIONS]] [--databases postgresql,mysql,sqlite]
                        [--json PATH] [section options: see --help]

Sections: ``core`` (publish, consume, latency, racers, Celery end to end against a raw
driver loop, kombu sqla, Redis and RabbitMQ), ``ordering`` (FIFO groups, partition keys,
NOTIFY latency), ``transactional`` (transactional vs plain tasks/s), ``outbox``
(apply_async overhead, republish rate), ``layout`` (a reply queue's life in the shared
transient table and in a table of its own), ``remote`` (``celery inspect ping`` round
trip, event delivery and heartbeats against Redis and RabbitMQ), ``scale`` (claim time,
drain rates and worker memory against the backlog's size). Each section module
also runs alone: ``python bench/ordering.py --help``.
Not a test: the figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the bench package, not its modules

from bench import core, layout, ordering, outbox, remote, scale, transactional  # noqa: E402
from bench.cli import main  # noqa: E402

SECTIONS = [core.SECTION, ordering.SECTION, transactional.SECTION, outbox.SECTION,
            layout.SECTION, remote.SECTION, scale.SECTION]

if __name__ == "__main__":
    sys.exit(main(SECTIONS, sys.argv[1:], (__doc__ or "").splitlines()[0]))
