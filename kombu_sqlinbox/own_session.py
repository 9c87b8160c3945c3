"""A connection of this process's own, out of the pool, for fenced work that should cost
one round trip a statement: the lease keeper's settlements, the wake-up's claims."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection

from .database import Database

T = TypeVar("T")


class OwnSession:
    """A connection of this process's own, out of the pool (its session settings stay its
    own), in autocommit, for fenced work whose commits need not wait for the disk: each
    statement is one round trip, with no pool checkout, ``BEGIN`` or ``COMMIT``, run as a
    prepared statement where the dialect can (:meth:`.Dialect.prepare_session`).
    ``setup`` runs first on the driver connection (the wake-up's LISTEN)."""

    def __init__(self, database: Database, setup: Callable[[Any], None] | None = None) -> None:
        self.database = database
        self.setup = setup
        self.driver: Any = None
        self.session: Connection | None = None
        self._pid = 0

    def connect(self) -> Connection:
        """Connect (again); a connection whose set-up fails is closed as it is."""
        raw = self.database.engine.raw_connection()
        driver: Any = raw.driver_connection  # read before detach() forgets it
        raw.detach()
        driver.autocommit = True
        session = Connection(self.database.engine, connection=raw)
        dialect = self.database.dialect
        try:
            if self.setup is not None:
                self.setup(driver)
            if dialect.relaxed_session:
                session.exec_driver_sql(dialect.relaxed_session)
                session.commit()
            dialect.prepare_session(session)
        except Exception:
            # the driver's own close: the session's would roll back first and, on a
            # broken connection, give up before closing it
            driver.close()
            raise
        self.driver, self.session, self._pid = driver, session, os.getpid()
        return session

    @staticmethod
    def commit(session: Connection, work: Callable[[Connection], T]) -> T:
        """Run ``work`` on ``session``; each statement committed as it ran (autocommit), the
        commit only ends SQLAlchemy's view of a transaction."""
        result = work(session)
        session.commit()
        return result

    @staticmethod
    def transaction(session: Connection, work: Callable[[Connection], T]) -> T:
        """Run ``work`` on ``session`` in one transaction, begun and committed as
        statements (the session stays in autocommit: no settings to switch back); rolled
        back when ``work`` fails, so that no lock it took outlives it (a connection found
        dead took its transaction with it: its error is raised, not SQLAlchemy's refusal
        of a statement on it)."""
        session.exec_driver_sql("BEGIN")
        try:
            result = work(session)
        except BaseException:
            if not session.invalidated:
                session.exec_driver_sql("ROLLBACK")
            session.rollback()
            raise
        session.exec_driver_sql("COMMIT")
        session.commit()
        return result

    def current(self) -> Connection | None:
        """The session, when there is one of this process (a forked child leaves its
        parent's alone)."""
        return self.session if self._pid == os.getpid() else None

    def drop(self) -> None:
        """Close the session without the pool's reset: in autocommit it has nothing to roll
        back, and dropped because it failed, it is often dead already (a reset would log
        an ERROR with a traceback, "connection already closed", for what is recovered).
        The driver's connection is closed here: invalidating a detached connection only
        forgets it, and a failing claim dropped once a round left one open each time."""
        session, driver = self.current(), self.driver
        if session is not None:
            session.invalidate()
            driver.close()  # the drivers' close() of a dead connection does not raise
        self.driver = self.session = None
