"""The faults of ``bench/chaos.py``, on the servers it is told about: restarts, sessions
ended, every connection slot taken, and how a worker's sessions are told from others'."""

from __future__ import annotations

import argparse
import os
import shlex
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import redis
from kombu import Connection
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from bench.targets import AMQP_URL, REDIS_URL, SERVERS
from tests.servers import server_answers

SQL = ("postgresql", "mysql", "sqlite")
#: how long ``hold`` keeps the connection slots filled and the rows locked
HOLD = 10.0
#: the longest a server may take to restart and answer again
RESTART_LIMIT = 120.0
#: per server: the environment variable of its URL and its default (the benchmark's), the
#: variable of its restart command and its default (the standard local services)
DEFAULTS = {
    "postgresql": ("CHAOS_POSTGRES_URL", SERVERS["postgresql"],
                   "CHAOS_RESTART_POSTGRESQL", "pg_ctlcluster 15 main restart"),
    "mysql": ("CHAOS_MYSQL_URL", SERVERS["mysql"], "CHAOS_RESTART_MYSQL",
              "mariadb-admin -uroot shutdown && "
              "start-stop-daemon --start --background --exec /usr/sbin/mariadbd"),
    "redis": ("CHAOS_REDIS_URL", REDIS_URL,
              "CHAOS_RESTART_REDIS", "service redis-server restart"),
    "rabbitmq": ("CHAOS_AMQP_URL", AMQP_URL,
                 "CHAOS_RESTART_RABBITMQ", "rabbitmqctl stop_app && rabbitmqctl start_app"),
}


class Servers:
    """Where each target's server is and how to restart it (options, else environment,
    else the standard local services)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.urls = {name: getattr(args, f"{name}_url") for name in DEFAULTS}
        self.restarts = {name: getattr(args, f"restart_{name}") for name in DEFAULTS}
        self.rabbitmqctl = shlex.split(args.rabbitmqctl)

    def answers(self, target: str) -> bool:
        """The server takes connections (again)."""
        try:
            if target in SQL:
                return server_answers(self.urls[target]) is None
            if target == "redis":
                return bool(redis.Redis.from_url(self.urls[target], socket_timeout=2).ping())
            with Connection(self.urls[target], connect_timeout=2) as conn:
                conn.ensure_connection(max_retries=1)
            return True
        except Exception:  # not there yet
            return False

    def restart(self, target: str, log: Path) -> float:
        """Run the restart command (its output to ``log``) and return when the server
        answered again (``time.time()``): the first answer after it was seen down, or after
        the command ended when it never was (polled every 0.1 s, for at most
        :data:`RESTART_LIMIT` s)."""
        deadline = time.monotonic() + RESTART_LIMIT
        with log.open("ab") as output:
            command = subprocess.Popen(self.restarts[target], shell=True, stdout=output,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        down, back = False, None
        while back is None:
            if time.monotonic() > deadline:
                command.kill()
                raise RuntimeError(f"{target} did not answer within {RESTART_LIMIT:.0f} s "
                                   f"of its restart; see {log}")
            ended = command.poll() is not None
            if not self.answers(target):
                down = True
            elif down or ended:
                back = time.time()
            time.sleep(0.1)
        if command.wait(max(1.0, deadline - time.monotonic())):
            raise RuntimeError(f"restart of {target} failed: see {log}")
        return back

    def terminate(self, target: str, ports: set[int]) -> int:
        """End the server's sessions of these client ports, as an operator (or a failover)
        would: PostgreSQL ``pg_terminate_backend``, MariaDB ``KILL``, Redis ``CLIENT
        KILL``, RabbitMQ ``close_connection``. The number ended."""
        if target in ("postgresql", "mysql"):
            query = ("SELECT pid, client_port FROM pg_stat_activity" if target == "postgresql"
                     else "SELECT id, SUBSTRING_INDEX(host, ':', -1) "
                          "FROM information_schema.processlist")
            end = "SELECT pg_terminate_backend(:id)" if target == "postgresql" else "KILL :id"
            with one_connection(self.urls[target]) as conn:
                ids = [ident for ident, port in conn.execute(text(query))
                       if str(port or "").isdigit() and int(port) in ports]
                for ident in ids:
                    with suppress(Exception):  # a session that ended meanwhile
                        conn.execute(text(end), {"id": ident})
            return len(ids)
        if target == "redis":
            client = redis.Redis.from_url(self.urls[target])
            addresses = [c["addr"] for c in client.client_list()
                         if int(c["addr"].rsplit(":", 1)[1]) in ports]
            for address in addresses:
                with suppress(redis.ResponseError):
                    client.client_kill(address)
            return len(addresses)
        listed = subprocess.run([*self.rabbitmqctl, "list_connections", "-q", "name",
                                 "peer_port"], capture_output=True, text=True, timeout=60)
        names = [line.rsplit("\t", 1)[0] for line in listed.stdout.splitlines()
                 if line.rsplit("\t", 1)[-1].isdigit() and int(line.rsplit("\t", 1)[1]) in ports]
        for name in names:
            subprocess.run([*self.rabbitmqctl, "close_connection", name, "chaos"],
                           capture_output=True, timeout=60)
        return len(names)

    @contextmanager
    def held(self, target: str, db: str | None, table: str) -> Iterator[str]:
        """The ``hold`` fault while the block runs: every connection slot of the server
        taken and the queue's rows locked by an open transaction (SQLite: a write
        transaction held open; Redis: ``CLIENT PAUSE``). Yields what was done."""
        if target == "redis":
            redis.Redis.from_url(self.urls[target]).client_pause(int(HOLD * 1000))
            yield f"clients paused {HOLD:.0f} s"
            return
        assert db is not None
        if target == "sqlite":
            conn = sqlite3.connect(db.removeprefix("sqlite:///"), timeout=30, isolation_level=None)
            conn.execute("BEGIN EXCLUSIVE")
            try:
                yield "a write transaction held open"
            finally:
                conn.rollback()
                conn.close()
            return
        engine = create_engine(db, poolclass=NullPool)
        with ExitStack() as stack:
            locker = stack.enter_context(engine.connect())
            quote = locker.dialect.identifier_preparer.quote
            locked = len(locker.execute(text(f"SELECT id FROM {quote(table)} FOR UPDATE")).all())
            taken = 1
            while taken < 2000:
                try:
                    stack.enter_context(engine.connect())
                except Exception:  # every slot taken: the server refuses more
                    break
                taken += 1
            yield f"{locked} rows locked, {taken} connections taken"
        engine.dispose()


@contextmanager
def one_connection(url: str) -> Iterator[Any]:
    engine = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def group_ports(pgid: int) -> set[int]:
    """The local TCP ports of every process in a process group (a worker and its pool),
    read from ``/proc``: how their server sessions are told from everyone else's."""
    return socket_ports(lambda stat: int(stat.rsplit(")", 1)[1].split()[2]) == pgid)


def process_ports(pid: int) -> set[int]:
    """The local TCP ports of one process (a worker's main process, not its pool)."""
    return socket_ports(lambda stat: int(stat.split(" ", 1)[0]) == pid)


def socket_ports(chosen: Callable[[str], bool]) -> set[int]:
    """The local TCP ports of the processes whose ``/proc/<pid>/stat`` line is ``chosen``."""
    inodes = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not chosen((entry / "stat").read_text()):
                continue
            for fd in (entry / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
