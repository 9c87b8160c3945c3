"""Row mode's argument columns: which values a column holds exactly.

A Celery task's arguments go into the columns of its row as they are, and a column
converts what it is given: ``1.5`` into a BIGINT comes back ``2``, ``"0042"`` comes back
``42``, MariaDB without a strict ``sql_mode`` cuts text to the column's length. A publish
checks each argument against its column's type, read from the database when the queue is
first used, and refuses what would not come back as it was sent.
"""

from __future__ import annotations

import math
import re
import struct
import uuid
from collections.abc import Callable
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import object_hook
from sqlalchemy import Connection, inspect
from sqlalchemy import types as sqltypes
from sqlalchemy.dialects import mysql
from sqlalchemy.dialects.sqlite.base import ischema_names as sqlite_type_names

from .tables import TableSpec

#: why a value does not fit a column exactly, or None when it does
Check = Callable[[Any], "str | None"]
#: the bits of each integer type the databases have, by SQLAlchemy's reflected type
INTEGER_BITS: tuple[tuple[type[Any], int], ...] = (
    (mysql.TINYINT, 8), (sqltypes.SmallInteger, 16), (mysql.MEDIUMINT, 24),
    (sqltypes.BigInteger, 64), (sqltypes.Integer, 32))


def row_checks(conn: Connection, spec: TableSpec
               ) -> tuple[tuple[tuple[str, Check], ...], frozenset[str]]:
    """The check of each row mode column whose type converts what it is given, or that
    is NOT NULL (a missing argument is written as NULL: its default never applies); and
    the columns written an argument's JSON text (PostgreSQL's json and jsonb)."""
    if not spec.row_columns:
        return (), frozenset()
    database = conn.dialect.name
    columns = {column["name"].lower(): column
               for column in inspect(conn).get_columns(spec.table, schema=spec.schema)}
    affine = _numeric_affinity(conn, spec) if database == "sqlite" else set()
    checks = []
    for name in spec.row_columns:
        column = columns[name.lower()]
        check = (_affine if name.lower() in affine
                 else column_check(database, column["type"]))
        found = _not_null(check, column["nullable"])
        if found is not None:
            checks.append((name, found))
    as_json = frozenset(name for name in spec.row_columns if database == "postgresql"
                        and isinstance(columns[name.lower()]["type"], sqltypes.JSON))
    return tuple(checks), as_json


def _numeric_affinity(conn: Connection, spec: TableSpec) -> set[str]:
    """SQLite columns whose declared type SQLAlchemy reads as a type it is not (a name
    SQLite does not know, such as ``UUID``, or ``JSON``): SQLite gives them numeric
    affinity, whatever the name says."""
    schema = f"{conn.dialect.identifier_preparer.quote(spec.schema)}." if spec.schema else ""
    table = conn.dialect.identifier_preparer.quote(spec.table)
    found = set()
    for row in conn.exec_driver_sql(f"PRAGMA {schema}table_info({table})"):
        name, declared = row[1], row[2].upper()
        base = re.split(r"[\s(]", declared, maxsplit=1)[0]
        # SQLite's own rules: a name with INT has integer affinity (which converts text as
        # numeric does), one with CHAR, CLOB, TEXT, BLOB, REAL, FLOA or DOUB another
        numeric = "INT" in declared or not re.search("CHAR|CLOB|TEXT|BLOB|REAL|FLOA|DOUB",
                                                     declared)
        if base and numeric and (base not in sqlite_type_names or base.startswith("JSON")):
            found.add(name.lower())
    return found


#: text SQLite's numeric affinity stores as a number
_NUMERAL = re.compile(r"\s*[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?\s*", re.ASCII)


def _affine(value: Any) -> str | None:
    """SQLite's numeric affinity keeps text as it is unless it reads as a number."""
    if isinstance(value, str):
        return ("text that reads as a number, which SQLite's numeric affinity (the "
                "column's type) would store as one") if _NUMERAL.fullmatch(value) else (
                    _unicode(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return _integer("sqlite", sqltypes.BigInteger())(value)
    return _double(value)


def _not_null(check: Check | None, nullable: bool) -> Check | None:
    if nullable:
        return check

    def not_null(value: Any) -> str | None:
        if value is None:
            return ("NULL (a missing argument is NULL too), and the column is NOT NULL (its "
                    "default, if any, applies only to columns an INSERT leaves out)")
        return None if check is None else check(value)

    return not_null


def column_check(database: str, kind: sqltypes.TypeEngine[Any]) -> Check | None:
    """How a column of ``kind`` on ``database`` (SQLAlchemy's dialect name) takes a value
    from JSON; None for a type that keeps any scalar as given (no declared type on SQLite,
    JSON other than PostgreSQL's, arrays)."""
    if isinstance(kind, sqltypes.JSON):
        return _json if database == "postgresql" else None
    if isinstance(kind, sqltypes.Boolean):
        return _boolean
    if isinstance(kind, sqltypes.Integer):
        return _integer(database, kind)
    if isinstance(kind, sqltypes.Float):
        single = (database == "postgresql" and isinstance(kind, sqltypes.REAL)) or (
            database in ("mysql", "mariadb") and isinstance(kind, sqltypes.FLOAT))
        return _single if single else _double
    if isinstance(kind, sqltypes.Numeric):
        return _decimal(kind.precision, kind.scale)
    if isinstance(kind, sqltypes.Uuid):
        return _uuid
    if isinstance(kind, sqltypes.Enum):
        return _one_of(tuple(kind.enums))
    if isinstance(kind, (sqltypes.String, sqltypes._Binary)):
        return _text(database, kind)
    if isinstance(kind, (sqltypes.DateTime, sqltypes.Date, sqltypes.Time)):
        return _moment(database, kind)
    return None


def tagged(value: Any) -> Any:
    """An argument as the value it stands for: kombu's JSON writes a ``Decimal``, a
    ``date``, a ``time``, a ``UUID`` as a tagged object (``{"__type__": "decimal",
    "__value__": "12.50"}``), which the checks see as the object it tags."""
    if isinstance(value, dict) and value.keys() == {"__type__", "__value__"}:
        return object_hook(value)
    return value


def json_text(value: Any) -> str:
    """An argument for a json/jsonb column: its JSON text, which the column parses back to
    the value (the drivers bind no object there, and text alone would be parsed)."""
    text: str = kombu_dumps(value, allow_nan=False)
    return text


def _json(value: Any) -> str | None:
    try:
        json_text(value)
    except ValueError as exc:
        return f"not JSON ({exc})"
    return None


def as_written(value: Any) -> Any:
    """A checked argument as it is bound: a tagged object as a row written with SQL would
    give it back, a decimal as a number (its text when fractional, which every database
    reads exactly), a time in ISO 8601, a UUID as its text."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else str(value)
    if isinstance(value, (date, time)):
        return value.isoformat()
    return str(value) if isinstance(value, uuid.UUID) else value


def _number(value: Any) -> str | None:
    """Why a value is no number to store: text, true or false, a list or object."""
    if isinstance(value, str):
        return "text, which the column would convert to a number"
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        return f"not a number but {type(value).__name__}"
    if not (value.is_finite() if isinstance(value, Decimal)
            else isinstance(value, int) or math.isfinite(value)):
        return "not a finite number"
    return None


def _boolean(value: Any) -> str | None:
    return None if value is None or isinstance(value, bool) else "the column takes true or false"


def _integer(database: str, kind: sqltypes.TypeEngine[Any]) -> Check:
    bits = 64 if database == "sqlite" else next(
        size for base, size in INTEGER_BITS if isinstance(kind, base))
    unsigned = bool(getattr(kind, "unsigned", False))
    low, high = (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    # MySQL's BOOLEAN is a TINYINT(1)
    flags = isinstance(kind, mysql.TINYINT) and getattr(kind, "display_width", None) == 1

    def check(value: Any) -> str | None:
        if value is None or (flags and isinstance(value, bool)):
            return None
        if isinstance(value, bool):
            return "true or false, which the column would store as 1 or 0"
        why = _number(value)
        if why is None and not isinstance(value, int) and value != int(value):
            why = "not a whole number: the column would round it"
        if why is None and not low <= value <= high:
            why = f"out of range for the column ({low} to {high})"
        return why

    return check


def _double(value: Any) -> str | None:
    if value is None:
        return None
    why = _number(value)
    if why is None and isinstance(value, (int, Decimal)):
        try:
            near = float(value)
        except OverflowError:
            return "out of range for a floating-point column"
        if (near != value if isinstance(value, int) else Decimal(repr(near)) != value):
            why = "a number double precision does not hold: the column would round it"
    return why


def _single(value: Any) -> str | None:
    why = _double(value)
    if why is None and value is not None:
        try:
            near = float(value)
            exact = struct.unpack("f", struct.pack("f", near))[0] == near
        except OverflowError:
            exact = False
        if not exact:
            why = "not held exactly in single precision: the column would round it"
    return why


def _decimal(precision: int | None, scale: int | None) -> Check:
    limit = 10 ** (precision - (scale or 0)) if precision is not None else 0

    def check(value: Any) -> str | None:
        if value is None:
            return None
        why = _number(value)
        if why is not None:
            return why
        if isinstance(value, int):  # the common cases without a Decimal (a publish's hot path)
            places = 0
        elif isinstance(value, float) and "e" not in (shown := repr(value)):
            places = len(shown.partition(".")[2].rstrip("0"))
        else:
            number = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
            places = max(0, -int(number.normalize().as_tuple().exponent))
        if scale is not None and places > scale:
            return f"has {places} decimal places, the column keeps {scale}: it would round it"
        if precision is not None and abs(value) >= limit:
            return f"too large for the column's {precision} digits, {scale or 0} of them decimal"
        return None

    return check


def _uuid(value: Any) -> str | None:
    if value is None or isinstance(value, uuid.UUID):
        return None
    try:
        canonical = isinstance(value, str) and str(uuid.UUID(value)) == value
    except ValueError:
        canonical = False
    return None if canonical else "not a UUID in its canonical form (lower case, hyphens)"


def _one_of(values: tuple[str, ...]) -> Check:
    """An enumeration takes its values as written: MariaDB's would take ``1`` as its
    first value and ``'OK'`` as ``'ok'`` (its collation ignores case)."""
    def check(value: Any) -> str | None:
        if value is None or (isinstance(value, str) and value in values):
            return None
        return f"not one of the column's values {', '.join(values)}"

    return check


def _unicode(value: str) -> str | None:
    """Why text no database stores as given: a NUL (PostgreSQL refuses it; refused on every
    database alike), a lone surrogate (not UTF-8 at all)."""
    if "\x00" in value:
        return "holds a NUL character, which PostgreSQL's text cannot"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate, which is not UTF-8"
    return None


def _bytes(value: bytes, length: int | None) -> str | None:
    """Why bytes do not fit a binary column: a row gives the column back as its text."""
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes that are not UTF-8: the row gives a binary column back as text"
    if length is not None and len(value) > length:
        return f"longer than {length} bytes in UTF-8: the column would cut it"
    return None


def _text(database: str, kind: sqltypes.TypeEngine[Any]) -> Check:
    length = getattr(kind, "length", None)
    padded = isinstance(kind, sqltypes.CHAR)
    binary = isinstance(kind, sqltypes._Binary)

    def check(value: Any) -> str | None:
        if value is None:
            return None
        if binary and isinstance(value, bytes):  # kombu's tagged bytes: bound as they are
            return _bytes(value, length)
        if not isinstance(value, str):
            return f"not text but {type(value).__name__}, which the column would convert"
        why = _unicode(value)
        if why is not None or not binary:
            pass
        elif database == "postgresql" and "\\" in value:  # stored as its UTF-8 bytes
            why = "holds a backslash, which bytea reads as an escape"
        else:
            why = _bytes(value.encode("utf-8"), length)
        if why is not None or binary:
            return why
        if length is not None and len(value) > length:
            return f"longer than {length} characters: the column would cut it"
        if padded and database == "postgresql" and len(value) < (length or 1):
            return f"shorter than {length or 1} characters: CHAR would pad it with spaces"
        if padded and database in ("mysql", "mariadb") and value.endswith(" "):
            return "ends in a space, which CHAR drops"
        return None

    return check


_TIME = r"\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:\d{2}(:\d{2})?)?"
#: the form each parser is given, and its example: ISO 8601's extended form, which every
#: database reads alike (Python also reads the basic form: MariaDB takes "1000" as 00:10)
_EXTENDED: dict[Callable[[str], date | time], tuple[re.Pattern[str], str]] = {
    date.fromisoformat: (re.compile(r"\d{4}-\d{2}-\d{2}", re.ASCII), "YYYY-MM-DD"),
    time.fromisoformat: (re.compile(_TIME, re.ASCII), "HH:MM:SS"),
    datetime.fromisoformat: (re.compile(rf"\d{{4}}-\d{{2}}-\d{{2}}([T ]{_TIME})?", re.ASCII),
                             "YYYY-MM-DDTHH:MM:SS"),
}


TIMESTAMP_RANGE = (datetime(1970, 1, 1, 0, 0, 1), datetime(2038, 1, 19, 3, 14, 7, 999999))


def _moment(database: str, kind: sqltypes.TypeEngine[Any]) -> Check:
    """Dates and times arrive as ISO 8601 text and leave as it: the column must keep the
    value's offset (or have none to keep) and its fractional seconds."""
    parse: Callable[[str], date | time] = (
        datetime.fromisoformat if isinstance(kind, sqltypes.DateTime)
        else time.fromisoformat if isinstance(kind, sqltypes.Time) else date.fromisoformat)
    form, example = _EXTENDED[parse]
    zoned = bool(getattr(kind, "timezone", False))
    # MariaDB/MySQL's TIMESTAMP: seconds of a signed 32-bit Unix time (the session is UTC)
    epoch = database in ("mysql", "mariadb") and isinstance(kind, sqltypes.TIMESTAMP)
    digits = 6 if database == "sqlite" else getattr(
        kind, "fsp" if database in ("mysql", "mariadb") else "precision", None)
    if digits is None:
        digits = 0 if database in ("mysql", "mariadb") else 6

    def check(value: Any) -> str | None:
        if isinstance(value, (date, time)):  # a tagged one: checked as its ISO 8601 text
            value = value.isoformat()
        if value is None:
            return None
        if not isinstance(value, str):
            return f"not text but {type(value).__name__}: a time is written in ISO 8601"
        try:
            moment = parse(value) if form.fullmatch(value) else None
        except ValueError:
            moment = None
        if moment is None:
            return f"not a valid time in ISO 8601's extended form ({example})"
        if isinstance(moment, date) and not isinstance(moment, datetime):
            return None
        if database != "sqlite" and (moment.tzinfo is not None) != zoned:
            return ("has a UTC offset, which the column drops" if moment.tzinfo is not None
                    else "has no UTC offset: the column would assume the session's")
        if (epoch and isinstance(moment, datetime) and moment.tzinfo is None
                and not TIMESTAMP_RANGE[0] <= moment <= TIMESTAMP_RANGE[1]):
            return (f"out of the column's range ({TIMESTAMP_RANGE[0].isoformat()} to "
                    f"{TIMESTAMP_RANGE[1].isoformat()}, UTC): use DATETIME for such times")
        fraction = f"{moment.microsecond:06d}".rstrip("0")
        if len(fraction) > digits:
            return f"has {len(fraction)} fractional digits, the column keeps {digits}"
        return None

    return check
