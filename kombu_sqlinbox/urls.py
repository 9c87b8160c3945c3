"""The broker URL as kombu holds it, as the transport shows it, and as SQLAlchemy opens it.

kombu keeps a ``sqlinbox+`` URL whole in the connection's ``hostname``, and Celery shows
that field (``celery inspect stats``, Flower's worker page) while it leaves out only the
``password`` field: so the URL's password is moved to that field, and put back only
where the transport connects.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from .dialects import SPELLINGS
from .errors import ConfigurationError

#: how a broker URL names this transport
URL_PREFIX = "sqlinbox+"
#: the password of ``scheme://user:password@host`` as SQLAlchemy reads it (up to the
#: first ``@``: it may hold ``/`` and ``;`` where not percent-encoded)
_PASSWORD = re.compile(r"(://[^/@:]*:)[^@]*@")
#: the same in a URL no parser reads (its ``://`` perhaps mistyped ``//``): up to its
#: last ``@``, as a password may hold ``@``
_ANY_PASSWORD = re.compile(r"(//[^/@:]*:).*@")
#: the same in one without even ``//`` (``postgresql:/app:pw@db``): from its first ``:``
#: on, the scheme's, as nothing tells where the user ends
_BARE_PASSWORD = re.compile(r"^([^@:]*:).*@")
#: the value of a query argument a driver takes a secret in (``?password=``,
#: ``sslpassword``, a token or key), up to the next argument
_SECRET_ARGUMENT = re.compile(r"([?&][^=&#]*(?:pass|pwd|secret|token|key)[^=&#]*=)[^&#]*",
                              re.IGNORECASE)
#: where a list of failover URLs is split: a ``;`` followed by the next URL's scheme
_NEXT_URL = re.compile(r";(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def masked(url: str, mask: str = "***") -> str:
    """``url`` (or each of ``;``-separated failover URLs) with its password, if any, and
    the values of its query arguments that name a secret shown as ``mask`` (by default as
    SQLAlchemy shows a password), whether or not the rest of it parses."""
    urls = failover_urls(url)
    if len(urls) > 1:
        return ";".join(masked(each, mask) for each in urls)
    url = _SECRET_ARGUMENT.sub(lambda found: found.group(1) + mask, url)
    parsed = _parsed(url)
    if parsed is not None and parsed.password is None:
        return url  # nothing to hide (a ``:`` and ``@`` further on are not a password)
    pattern = (_PASSWORD if parsed is not None
               else _ANY_PASSWORD if "//" in url else _BARE_PASSWORD)
    return pattern.sub(lambda found: f"{found.group(1)}{mask}@", url, count=1)


def failover_urls(url: str) -> list[str]:
    """The URLs of a ``;``-separated failover list (one URL: itself)."""
    return _NEXT_URL.split(url)


def _parsed(url: str) -> URL | None:
    try:
        return make_url(url)
    except (ArgumentError, ValueError):  # refused where the transport connects
        return None


def conceal_password(client: Any) -> None:
    """Move the password of the URL in the kombu connection ``client``'s ``hostname`` to
    its ``password`` field (what kombu and Celery leave out of what they show); clones of
    the connection carry both fields."""
    hostname = client.hostname
    parsed = _parsed(hostname) if isinstance(hostname, str) and "://" in hostname else None
    if parsed is None or parsed.password is None:
        return
    client.password = parsed.password
    # set(password=None) would leave it as it is
    client.hostname = parsed._replace(password=None).render_as_string(hide_password=False)


def client_url(client: Any) -> str:
    """The SQLAlchemy URL (password included) the kombu connection ``client`` names:
    its ``hostname`` with the password field put back, or the parts of an alternate URL
    kombu's failover parsed itself, put back together."""
    hostname = client.hostname or ""
    scheme = str(client.transport_cls or "")
    if "://" not in hostname and scheme.startswith(URL_PREFIX):
        return URL.create(
            scheme[len(URL_PREFIX):], username=client.userid, password=client.password,
            host=hostname or None, port=client.port,
            database=None if client.virtual_host in (None, "/") else client.virtual_host,
        ).render_as_string(hide_password=False)
    if "://" not in hostname:
        raise ConfigurationError(
            "the sqlinbox transport needs an SQLAlchemy URL: "
            "broker='sqlinbox+postgresql://user@host/db' or 'sqlinbox+sqlite:///jobs.db'"
        )
    parsed = _parsed(hostname) if client.password or client.userid else None
    if parsed is None:
        return str(hostname)
    # the URL's own user and password first (kombu's rule), then the connection's fields
    # (Celery's broker_user, broker_password): a password needs a user to be passed on
    if parsed.username is None and client.userid:
        parsed = parsed.set(username=client.userid)
    if parsed.password is None and client.password:
        parsed = parsed.set(password=client.password)
    return parsed.render_as_string(hide_password=False)


def shown_uri(client: Any, include_password: bool, mask: str) -> str:
    """The ``sqlinbox+`` URL of ``client`` as kombu's ``as_uri()`` shows it: the password
    given as ``mask`` unless ``include_password``."""
    try:
        url = client_url(client)
    except ConfigurationError:  # shown as given: connecting says what is wrong with it
        url = str(client.hostname or "")
    return URL_PREFIX + (url if include_password else masked(url, mask))


def refuse_alternates_with_query(alternates: Sequence[Any]) -> None:
    """kombu's failover parses an alternate URL itself and passes its query string on as
    connection arguments: a failover to one would fail (or drop the settings), so a
    broker URL with alternates is refused at start-up when one has a query string."""
    if len(alternates) < 2:
        return
    for url in alternates:
        if isinstance(url, str) and "://" in url and urlsplit(url).query:
            raise ConfigurationError(
                f"broker URL {masked(url)!r}: with failover URLs, no URL may have a query "
                "string (kombu's failover cannot pass it on); give driver settings as "
                "transport option engine_options={'connect_args': {...}}, which every URL "
                "shares")


#: drivers tried, in order, for a URL that names no driver (SQLAlchemy's own default
#: first where it has one installed)
BARE_DRIVERS = {
    "postgresql": (("psycopg", "psycopg"), ("psycopg2", "psycopg2")),
    "mysql": (("MySQLdb", "mysqldb"), ("pymysql", "pymysql")),
    "mariadb": (("MySQLdb", "mysqldb"), ("pymysql", "pymysql")),
}
#: the kombu-sqlinbox extra that installs each driver it supports
DRIVER_EXTRAS = {"psycopg": "postgres", "psycopg2": "psycopg2", "pymysql": "mysql"}
#: the package on PyPI of an SQLAlchemy driver whose name is not its package's
DRIVER_PACKAGES = {"mysqldb": "mysqlclient", "mysqlconnector": "mysql-connector-python",
                   "mariadbconnector": "mariadb"}


def _install_hint(drivers: Sequence[str]) -> str:
    """How to install the first of ``drivers``: the extra that brings it, else its package."""
    extra = next((DRIVER_EXTRAS[name] for name in drivers if name in DRIVER_EXTRAS), None)
    if extra:
        return f"pip install 'kombu-sqlinbox[{extra}]'"
    return f"pip install {DRIVER_PACKAGES.get(drivers[0], drivers[0])}"


def sqlalchemy_url(url: str) -> URL:
    """The SQLAlchemy URL behind ``sqlinbox+...`` (given with or without that prefix). A URL
    naming no driver (``postgresql://``, ``mysql://``) takes whichever supported driver is
    installed; ``postgres://`` is read as ``postgresql://``, and a scheme in any case as
    in lower case."""
    try:
        parsed = make_url(url.removeprefix("sqlinbox+"))
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        parsed = None
    if parsed is None or parsed.drivername == "sqlinbox":
        raise ConfigurationError(
            f"broker URL {masked(url)!r} is not an SQLAlchemy URL; write e.g. "
            "sqlinbox+postgresql://user@host/db or sqlinbox+sqlite:///jobs.db"
        )
    # a URL's scheme is case-insensitive; SQLAlchemy's dialect names are lower case
    backend, plus, driver = parsed.drivername.lower().partition("+")
    parsed = parsed.set(drivername=SPELLINGS.get(backend, backend) + plus + driver)
    candidates = BARE_DRIVERS.get(parsed.drivername)
    if candidates is None:
        return _driver_installed(parsed, url)
    for module, driver in candidates:
        try:
            found = __import__(module)
        except ImportError:
            continue
        if found.__name__ != module:
            continue  # a stand-in (pymysql.install_as_MySQLdb()): its own driver comes next
        return parsed.set(drivername=f"{parsed.drivername}+{driver}")
    modules = " or ".join(module for module, _ in candidates)
    raise ConfigurationError(
        f"a {parsed.drivername}:// URL needs a driver, {modules}, and neither is installed: "
        f"{_install_hint([driver for _, driver in candidates])}"
    )


def _driver_installed(parsed: URL, given: str) -> URL:
    """``parsed``, whose driver imports; else the error naming the extra that installs it
    (SQLAlchemy would raise the driver's bare ImportError when the engine is made)."""
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:  # no such database: refused by its name where it is served
        return parsed
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise ConfigurationError(
            f"URL {masked(given)!r} names the driver {dialect.driver!r}, which is not "
            f"installed ({exc}): {_install_hint([dialect.driver])}") from None
    return parsed
