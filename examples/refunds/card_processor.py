"""A stand-in for the card processor's refund API, with idempotency keys.

``POST /refunds`` with an ``Idempotency-Key`` header refunds once per key: asked
again, it answers with the first refund's reference and pays nothing more. That
is what makes calling it from a task safe, since a task may run its body again
after a timeout or a crash.

The demonstration and the tests steer it: :meth:`FakeCardProcessor.time_out_once`
makes the first call for an order refund the money and then answer too late (the
case an idempotency key exists for), and :meth:`FakeCardProcessor.hold_once`
keeps the first call waiting until :meth:`FakeCardProcessor.release`.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: the longest a held or late answer waits (a forgotten hold still ends)
WAIT_LIMIT = 60.0


class FakeCardProcessor:
    """The processor on a local port, serving from a thread until :meth:`close`."""

    def __init__(self, late_by: float = 2.0) -> None:
        #: how long a timed-out call waits before its (unread) answer; beyond the client's
        self.late_by = late_by
        self._lock = threading.Condition()
        self._references: dict[str, str] = {}
        self._late: set[str] = set()
        self._held: set[str] = set()
        self._holding: set[str] = set()
        self._closed = threading.Event()
        self.calls: Counter[str] = Counter()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- steering ----------------------------------------------------------------------
    def time_out_once(self, order_id: str) -> None:
        """The next call for this order refunds, then answers after the client gave up."""
        with self._lock:
            self._late.add(order_id)

    def hold_once(self, order_id: str) -> None:
        """The next call for this order waits for :meth:`release` before it refunds."""
        with self._lock:
            self._held.add(order_id)

    def wait_held(self, order_id: str, timeout: float) -> bool:
        """Wait until a held call for this order has arrived; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: order_id in self._holding, timeout)

    def release(self, order_id: str) -> None:
        with self._lock:
            self._held.discard(order_id)
            self._holding.discard(order_id)
            self._lock.notify_all()

    # -- what happened -------------------------------------------------------------------
    def refunded(self) -> dict[str, str]:
        """Idempotency key -> reference of every refund actually paid (one per key)."""
        with self._lock:
            return dict(self._references)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._held.clear()
            self._holding.clear()
            self._lock.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # -- the API -----------------------------------------------------------------------
    def _refund(self, key: str, order_id: str) -> str:
        with self._lock:
            self.calls[order_id] += 1
            if order_id in self._held:
                self._held.discard(order_id)
                self._holding.add(order_id)
                self._lock.notify_all()
                self._lock.wait_for(lambda: order_id not in self._holding or
                                    self._closed.is_set(), WAIT_LIMIT)
            late = order_id in self._late
            self._late.discard(order_id)
            reference = self._references.setdefault(key, f"re_{len(self._references) + 1:06d}")
        if late:
            self._closed.wait(self.late_by)
        return reference

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        processor = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body: dict[str, Any] = json.loads(
                    self.rfile.read(int(self.headers["Content-Length"])))
                key = self.headers.get("Idempotency-Key")
                if self.path != "/refunds" or not key:
                    self.send_error(400, "POST /refunds with an Idempotency-Key")
                    return
                reference = processor._refund(key, str(body["order_id"]))
                answer = json.dumps({"reference": reference}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:  # the client stopped waiting: it will ask again
                    pass

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the demonstration prints its own account."""

        return Handler
