"""An event monitor in a process of its own, for a test to kill with ``kill -9``: an
``EventReceiver`` of the example app whose queue expires ``argv[1]`` seconds after its
last use, printing each event's type as it arrives."""

from __future__ import annotations

import os
import sys

from monitor_app import make_app  # type: ignore[import-not-found]


def main() -> None:
    app = make_app(os.environ["MONITOR_BROKER"], os.environ["MONITOR_TABLE_PREFIX"])
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(
            conn, handlers={"*": lambda event: print(event["type"], flush=True)},
            queue_expires=float(sys.argv[1]))
        receiver.capture(limit=None, timeout=None, wakeup=True)


if __name__ == "__main__":
    main()
