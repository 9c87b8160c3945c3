"""Benchmark kombu-sqlinbox side by side with kombu sqla, raw drivers, Redis and RabbitMQ.

    python bench/run.py [--quick] [--databases postgresql,mysql,sqlite]
                        [--brokers sqlinbox,sqla,raw,redis,rabbitmq]
                        [--only publish,consume,latency,race,celery,raw]
                        [--pg-driver psycopg2|psycopg] [--json PATH]

Prints a Markdown table per database and the ratios issue 2 sets as targets.
Not a test: the figures depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)  # import the bench package, not its modules as top-level names

from bench import celery_bench, kombu_bench, raw  # noqa: E402, F401  (scenarios register)
from bench.registry import SCENARIOS, Cell  # noqa: E402
from bench.report import Results, markdown, write_json  # noqa: E402
from bench.targets import BROKERS, DATABASES, Context, Sizes, Target  # noqa: E402


def names(value: str, allowed: tuple[str, ...] | list[str]) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(allowed)}")
    return chosen


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a fifth of the messages")
    parser.add_argument("--databases", default=",".join(DATABASES),
                        type=lambda v: names(v, DATABASES))
    parser.add_argument("--brokers", default=",".join(BROKERS), type=lambda v: names(v, BROKERS))
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        type=lambda v: names(v, list(SCENARIOS)), help="scenarios to run")
    parser.add_argument("--pg-driver", default="psycopg2", choices=("psycopg2", "psycopg"),
                        help="PostgreSQL driver of the sqlinbox and sqla brokers")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    return parser.parse_args(argv)


def measure(target: Target, ctx: Context, only: list[str], results: Results,
            began: float) -> None:
    cells = results.setdefault((target.database, target.broker), {})
    for scenario in sorted((SCENARIOS[name] for name in only), key=lambda s: s.rank):
        if target.broker not in scenario.brokers:
            continue
        try:
            found = scenario.run(target, ctx)
        except Exception as exc:  # one broker failing must not end the run
            found = dict.fromkeys(scenario.columns, Cell.failed(exc))
        cells.update(found)
        shown = ", ".join(f"{k}={c.text}" for k, c in found.items())
        print(f"[{time.monotonic() - began:6.1f}s] {target.label} {scenario.name}: {shown}",
              file=sys.stderr, flush=True)
        gc.collect()  # let closed kombu sqla channels give their sessions back


def main(argv: list[str]) -> int:
    args = parse(argv)
    sizes = Sizes().quick() if args.quick else Sizes()
    ctx = Context(sizes, args.pg_driver)
    brokers = set(args.brokers)
    results: Results = {}
    began = time.monotonic()
    print(f"run {ctx.run_id}: tables prefixed {ctx.prefix}, scratch {ctx.scratch}",
          file=sys.stderr)
    try:
        targets = ctx.server_targets(brokers)
        for database in args.databases:
            targets += ctx.targets(database, brokers)
        for target in targets:
            measure(target, ctx, args.only, results, began)
    finally:
        from kombu_sqlinbox.broker import close_all

        close_all()
        gc.collect()
        ctx.cleanup()
    print(f"\nRun {ctx.run_id}{' (quick)' if args.quick else ''}, "
          f"{time.monotonic() - began:.0f} s. Other work on this 2-core machine makes the "
          "figures noisy.\n")
    print(markdown(results, args.databases, ctx))
    if args.json:
        write_json(args.json, results, args.databases, ctx, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
