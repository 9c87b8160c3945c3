"""A TCP proxy in front of a database server, to break connections on purpose.

Tests point a broker URL at :attr:`Proxy.port` and then cut every connection
(:meth:`Proxy.cut`), refuse new ones for a while (:meth:`Proxy.refuse`), or cut a
connection right after it forwarded a ``COMMIT`` to the server, before the reply
comes back (:meth:`Proxy.cut_after_commit`): the commit lands, the client never
learns it did. The servers themselves are never touched.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator

from sqlalchemy.engine import make_url

#: how long the proxy lets a forwarded COMMIT reach and run on the server before it cuts
COMMIT_SETTLES = 0.3


class Proxy:
    """Forwards 127.0.0.1:<port> to ``host:port``, one thread per connection."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._refusing = False
        self._commit_cuts = 0
        self._marker = b"COMMIT"
        self.commits_cut = 0
        #: connections refused so far (inside :meth:`refuse`)
        self.refused = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` (an SQLAlchemy URL of the target server) through this proxy."""
        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(
            hide_password=False)

    def cut(self) -> None:
        """Close every connection going through the proxy now."""
        with self._lock:
            pairs, self._pairs = self._pairs, set()
        for pair in pairs:
            _close(pair)

    @contextlib.contextmanager
    def refuse(self) -> Iterator[None]:
        """Cut every connection and refuse new ones inside the block."""
        self._refusing = True
        try:
            self.cut()
            yield
        finally:
            self._refusing = False

    def blink(self, seconds: float) -> threading.Timer:
        """Cut every connection and refuse new ones for ``seconds`` (a failover, a proxy
        restarting), then let them in again; the timer that does it, started."""
        self._refusing = True
        self.cut()
        back = threading.Timer(seconds, setattr, (self, "_refusing", False))
        back.start()
        return back

    def cut_after_commit(self, times: int = 1, marker: bytes = b"COMMIT") -> None:
        """The next ``times`` COMMITs (statements holding ``marker``: one that commits
        itself) are forwarded, then their connection is cut before the server's reply
        reaches the client."""
        with self._lock:
            self._commit_cuts += times
            self._marker = marker

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing:
                client.close()
                self.refused += 1
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            pair = (client, server)
            with self._lock:
                self._pairs.add(pair)
            threading.Thread(target=self._pump, args=(pair,), daemon=True).start()

    def _pump(self, pair: tuple[socket.socket, socket.socket]) -> None:
        client, server = pair
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [], 1.0)
                if not ready and pair not in self._pairs:
                    return
                for source in ready:
                    data = source.recv(65536)
                    if not data:
                        return
                    if source is client:
                        server.sendall(data)
                        if self._marker in data and self._take_commit_cut():
                            time.sleep(COMMIT_SETTLES)
                            return
                    else:
                        client.sendall(data)
        except (OSError, ValueError):  # cut: the sockets were closed under us
            return
        finally:
            with self._lock:
                self._pairs.discard(pair)
            _close(pair)

    def _take_commit_cut(self) -> bool:
        with self._lock:
            if not self._commit_cuts:
                return False
            self._commit_cuts -= 1
            self.commits_cut += 1
            return True


def _close(pair: tuple[socket.socket, socket.socket]) -> None:
    for sock in pair:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
