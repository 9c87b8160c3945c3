"""The wake-up: what an idle consumer waits on instead of sleeping a whole polling
interval.

:class:`Wakeup` returns early on a PostgreSQL NOTIFY for a consumed table, an
in-process poke (a local publish, a partition key freed) or, on SQLite, the same-host
:class:`LocalSignal`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from .database import Database
from .dialects.base import no_wakeups
from .own_session import OwnSession

#: the wake-up's records keep the logger they had beside the claim forms: the docs name it,
#: and operators' logging settings select it
logger = logging.getLogger("kombu_sqlinbox.claims")
T = TypeVar("T")


#: how old (ns) a directory's modification time must be for its last listing to hold
SETTLED_NS = 1_000_000_000


class LocalSignal:
    """Wake-ups between the processes of one host, without the database server (SQLite).

    Each consuming process binds a Unix datagram socket in a directory next to the
    database file; a publisher sends a byte to every socket there after its commit.
    The byte is only a hint: the row is in the table whatever becomes of it, and a
    consumer that missed one finds the row at its next poll. A socket whose process
    died (a ``kill -9`` leaves it behind) refuses the byte, and the publisher removes it.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.socket: socket.socket | None = None
        self.path: str | None = None
        self.failed = False
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)
        self._pid = os.getpid()
        #: the file :meth:`mark` stamps (beside the directory: a file in it would be taken
        #: for a dead socket), and its stamp at the last look
        self._marks = directory.rstrip(os.sep) + ".changed"
        self._marked: int | None = None
        #: the names in the directory and its modification time (ns) when they were listed
        #: (-1 when listed too soon after it: see :meth:`_names`)
        self._listing: tuple[int, list[str]] = (-1, [])

    def bind(self) -> socket.socket | None:
        """This process's socket, bound on first need; None when the directory cannot
        hold one (not writable, the path too long): the consumer polls."""
        if self.socket is None and not self.failed:
            path = os.path.join(self.directory, f"{os.getpid()}-{os.urandom(3).hex()}")
            bound = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                os.makedirs(self.directory, exist_ok=True)
                bound.bind(path)
            except OSError as exc:
                bound.close()
                self.failed = True
                no_wakeups(self.directory, exc)
                return None
            bound.setblocking(False)
            self.socket, self.path = bound, path
        return self.socket

    def send(self) -> None:
        """Wake every consumer of the database on this host (after a commit)."""
        try:
            names = self._names()
        except OSError:  # no consumer ever bound here
            return
        for name in names:
            path = os.path.join(self.directory, name)
            if path == self.path:
                continue  # this process's own consumers are poked through its pipe
            try:
                self._sender.sendto(b"!", path)
            except ConnectionRefusedError:  # nobody reads it: its process died
                # another publisher removed it first, or it is no socket (a directory)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            except OSError:  # its queue is full (a wake-up is pending), or it just went
                pass

    def _names(self) -> list[str]:
        """The directory's sockets, listed again only when it changed since (a publish
        costs a ``stat`` rather than a listing). A listing taken less than
        :data:`SETTLED_NS` after the directory's last change is not kept: file system
        clocks are coarse, and a socket bound later in the same tick leaves the
        modification time as it was."""
        modified = os.stat(self.directory).st_mtime_ns
        listed_at, names = self._listing
        if modified != listed_at:
            settled = time.time_ns() - modified >= SETTLED_NS
            names = os.listdir(self.directory)
            self._listing = (modified if settled else -1, names)
        return names

    def take(self) -> None:
        """Read the bytes that arrived, so that the next wait blocks."""
        assert self.socket is not None
        with contextlib.suppress(BlockingIOError):
            while self.socket.recv(4096):
                pass

    def mark(self) -> None:
        """Say that what consumers watch changed (a pause), before :meth:`send`: a file
        beside the directory, stamped now. A byte could be lost (a socket's queue is full
        while its consumer claims); the stamp is there at its next look."""
        with open(self._marks, "a"):
            pass
        now = time.time_ns()
        os.utime(self._marks, ns=(now, now))

    def changed(self) -> bool:
        """Whether :meth:`mark` ran since the last look (a ``stat``; not at the first)."""
        try:
            stamp = os.stat(self._marks).st_mtime_ns
        except OSError:  # never marked
            stamp = 0
        seen, self._marked = self._marked, stamp
        return seen is not None and stamp != seen

    def close(self) -> None:
        self._sender.close()
        if self.socket is not None:
            self.socket.close()
            if self._pid == os.getpid():  # a forked child leaves its parent's socket
                with contextlib.suppress(OSError):
                    os.unlink(self.path or "")
            self.socket = None


class Wakeup:
    """What an idle consumer waits on instead of sleeping a whole polling interval: an
    in-process pipe (a local publish, a key set free), PostgreSQL's LISTEN connection,
    and on SQLite the same-host :class:`LocalSignal`.

    Threads of one process share it (an event receiver in one, ``inspect`` calls in
    another, as in Flower): every use of the LISTEN connection and its channels holds
    :attr:`_lock`, as psycopg2 connections are not safe to use from two threads at once;
    the wait itself (``select``) does not.

    The LISTEN connection also runs the process's lease claims (:meth:`claim`): in
    autocommit, a claim is one round trip straight after the wake-up, with no pool
    checkout, BEGIN or COMMIT.
    """

    def __init__(self, database: Database, local: bool = True) -> None:
        self.database = database
        self.dialect = database.dialect
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._channels: set[str] = set()
        #: channels no queue here is on any more, still LISTENed by the session: UNLISTENed
        #: with the next channel added, in its round trip (:meth:`unwatch`)
        self._dropped: set[str] = set()
        #: what to call when a wake-up says that what it watches changed (:meth:`watch`)
        self._watchers: dict[str | None, Callable[[], None]] = {}
        #: it only claims, settles and listens: see :class:`OwnSession`
        self._own = OwnSession(database, lambda driver: self.dialect.listen(driver,
                                                                            self._channels))
        self._lock = threading.Lock()
        directory = self.dialect.signal_directory() if local else None
        self.signal = LocalSignal(directory) if directory else None
        self._consuming = False
        self._closed = False

    def poke(self) -> None:
        """Wake a consumer of this process now (a local publish, a key set free). Not once
        closed: a channel may outlive its broker (``close_all`` at a test's end) and
        publish on, and the pipe's descriptors may by then be another file's."""
        if self._closed:
            return
        with contextlib.suppress(BlockingIOError):  # a full pipe: a wake-up is pending
            os.write(self._write, b"!")

    def published(self) -> None:
        """A publish committed: wake the consumers of this process (when it has any: a
        consumer registers before its first claim, which finds the row) and, where there
        is a same-host signal, those of the other processes."""
        if self._consuming:
            self.poke()
        if self.signal is not None:
            self.signal.send()

    def listen(self, name: str | None) -> None:
        """This process consumes: ask for a NOTIFY wake-up on channel ``name`` (a consumed
        queue's) where the database has them, and for the same-host signal, whose socket
        is bound here, before the consumer's first claim: bound at its first wait, a
        publish between that claim and the wait would find no socket to wake."""
        self._consuming = True
        if self.signal is not None:
            self.signal.bind()
        if name is None:
            return
        with self._lock:
            if name in self._channels:
                return
            self._channels.add(name)
            if self._listener is not None:
                if name in self._dropped:  # the session still LISTENs on it
                    self._dropped.discard(name)
                    return
                try:
                    self.dialect.listen(self._listener, [name], connecting=False,
                                        dropped=sorted(self._dropped))
                    self._dropped.clear()
                except Exception:
                    self._drop_listener()
                return
        self.poke()  # a consumer waiting in an event loop connects the listener now

    def watch(self, name: str | None, changed: Callable[[], None]) -> None:
        """Call ``changed`` when a wake-up says so: a NOTIFY on channel ``name`` (None:
        the database has none), the same-host signal's mark (:meth:`LocalSignal.mark`),
        and each time the LISTEN connection is made (what was notified while there was
        none is lost)."""
        self._watchers[name] = changed
        self.listen(name)

    def unwatch(self, name: str) -> None:
        """No queue of this process is on channel ``name`` any more (deleted here): its
        watcher goes, and the session UNLISTENs it with the next channel added (each
        ping's reply queue has a channel of its own: the session's grew by one a call)."""
        with self._lock:
            self._watchers.pop(name, None)
            if name in self._channels:
                self._channels.discard(name)
                if self._listener is not None:
                    self._dropped.add(name)

    def _marked(self) -> None:
        """Tell the watchers when the same-host signal's stamp changed."""
        if self._watchers and self.signal is not None and self.signal.changed():
            self._changed(list(self._watchers))

    def _changed(self, channels: Collection[str | None]) -> None:
        for name in channels:
            changed = self._watchers.get(name)
            if changed is not None:
                changed()

    @property
    def _listener(self) -> Any:
        """The DBAPI connection that LISTENs, if connected."""
        return self._own.driver

    @property
    def _session(self) -> Connection | None:
        """The same, as SQLAlchemy runs statements."""
        return self._own.session

    def _listening(self) -> Connection | None:
        """The LISTEN connection's session, connected when a queue is consumed and there is
        none (the first claim or wait, and again after it died); None while the database
        is away (call locked). A consumer with a backlog claims before it ever waits, so
        its claims run on this connection from the first."""
        if self._closed:  # a channel outliving its broker: the pool, no LISTEN session
            return None
        if self._channels and self._listener is None:
            try:
                self._own.connect()
            except Exception as exc:  # the database is away: poll until it is back
                logger.warning("sqlinbox: LISTEN connection failed (%s); polling until "
                               "it works", exc)
            else:
                self._changed(list(self._watchers))
        return self._session

    def _drop_listener(self) -> None:
        """Drop the LISTEN connection: what was notified on it may be lost, so the
        watchers look again."""
        self._own.drop()
        self._dropped.clear()  # the next session LISTENs on what is watched alone
        self._changed(list(self._watchers))

    def claim(self, work: Callable[[Connection], T]) -> T:
        """Run a claim (one repeatable statement) on the LISTEN connection when it is up
        and its driver keeps what arrives during a statement (a notification that did is
        a pending wake-up); else, or when that connection fails, in a transaction of the
        pool's. Either way its commit does not wait for the disk."""
        return self._claim(work, self._own.commit)

    def claim_in_transaction(self, work: Callable[[Connection], T]) -> T:
        """Run a claim of several statements (fenced: repeatable) as :meth:`claim` does,
        in one transaction on the LISTEN connection: no pool checkout, no setting of the
        commit's durability, its statements prepared there."""
        return self._claim(work, self._own.transaction)

    def publish(self, work: Callable[[Connection], T]) -> T:
        """Run a publish of transient messages (one statement whose commit need not wait
        for the disk) as :meth:`claim_in_transaction` runs a claim: no pool checkout, no
        setting of the commit's durability, its statement prepared there; run again on
        the pool when it fails before its COMMIT (nothing landed), raised when its
        COMMIT fails (it may have landed), as the pool's lost commit is."""
        ran = False

        def then_commit(conn: Connection) -> T:
            nonlocal ran
            result = work(conn)
            ran = True  # what fails from here on is the COMMIT
            return result

        return self._claim(then_commit, self._own.transaction, landed=lambda: ran)

    def _claim(self, work: Callable[[Connection], T],
               run: Callable[[Connection, Callable[[Connection], T]], T],
               landed: Callable[[], bool] | None = None) -> T:
        """``work`` by ``run`` on the LISTEN connection (see :meth:`claim`); when that
        fails, on the pool: again, unless ``landed`` says it may have landed (it is
        raised then), and as repeatable work unless ``landed`` is given."""
        with self._lock:
            session = self._listening()
            if session is not None and self.dialect.keeps_notifications(self._listener):
                try:
                    result = run(session, work)
                except DBAPIError as exc:
                    self._drop_listener()
                    if landed is not None and landed():
                        raise
                    logger.warning("sqlinbox: work on the LISTEN connection failed (%s); "
                                   "running it on the pool", exc)
                except BaseException as exc:
                    # interrupted mid-statement (KeyboardInterrupt, a greenlet's timeout):
                    # SQLAlchemy invalidated the session, whose driver connection may be
                    # left in a transaction; closed, the server rolls it back
                    if session.invalidated or not isinstance(exc, Exception):
                        self._drop_listener()
                    raise
                else:
                    try:
                        self._take_arrived()
                    except self.database.engine.dialect.loaded_dbapi.Error:
                        self._drop_listener()  # the work is done; the connection died after it
                    return result
        return self.database.run(work, durable=False, repeatable=landed is None)

    def _take_arrived(self) -> None:
        """Read what arrived on the LISTEN connection: the watchers of what was notified
        look again (call locked)."""
        arrived = self.dialect.take_notifications(self._listener)
        if arrived:
            self._changed(arrived)
            self.poke()

    def sources(self) -> list[Any]:
        """What a consumer waits on: the in-process pipe; the LISTEN connection where the
        database has NOTIFY and a queue is consumed (connected on first need, and again
        after it died; while the database is away, none: the consumer polls); the
        same-host signal's socket where there is one."""
        sources: list[Any] = [self._read]
        with self._lock:
            self._listening()
            if self._listener is not None:
                sources.append(self._listener)
        if self._consuming and self.signal is not None and self.signal.bind() is not None:
            sources.append(self.signal.socket)
        return sources

    def take(self, ready: Collection[Any]) -> None:
        """Consume the wake-ups of the ``ready`` sources, so that the next wait blocks."""
        if self._read in ready:
            try:
                while os.read(self._read, 4096):
                    pass
            except BlockingIOError:
                pass
        if self.signal is not None and self.signal.socket in ready:
            self.signal.take()
            self._marked()
        with self._lock:
            # the listener waited on: another thread may have dropped it meanwhile
            if self._listener is not None and self._listener in ready:
                try:
                    self._changed(self.dialect.take_notifications(self._listener))
                except Exception:
                    self._drop_listener()

    def check(self) -> None:
        """Take what the LISTEN connection and the same-host signal brought already,
        without waiting (a select and a ``stat``, no round trip), so that a watched change
        told before a claim counts for it; what they brought still wakes the next wait.
        The in-process pipe is left alone (it tells no change), and no listener is
        connected here."""
        with self._lock:
            sources = [] if self._listener is None else [self._listener]
        if self.signal is not None and self.signal.socket is not None:
            sources.append(self.signal.socket)
        if sources and self._wait(sources, 0):
            self.poke()
        self._marked()  # a mark whose byte was lost (a full queue)

    def wait(self, timeout: float) -> None:
        """Return after a wake-up or ``timeout`` seconds, whichever comes first."""
        self._wait(self.sources(), timeout)

    def _wait(self, sources: list[Any], timeout: float) -> bool:
        """Wait on ``sources`` and take what arrived; whether anything did."""
        try:
            ready, _, _ = select.select(sources, [], [], timeout)
        except (OSError, ValueError):  # the listener's socket died under us
            with self._lock:
                if self._listener is not None and self._listener in sources:
                    self._drop_listener()
            return False
        self.take(ready)
        return bool(ready)

    def close(self) -> None:
        """Drop the listener, the signal and the pipe; once only (a descriptor closed twice
        may close another file's)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_listener()
        if self.signal is not None:
            self.signal.close()
        os.close(self._read)
        os.close(self._write)
