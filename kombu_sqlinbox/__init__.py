"""kombu-sqlinbox: Celery task queues in tables of your own SQL database.

Importing the package registers the ``sqlinbox`` transport alias, so
``broker="sqlinbox+postgresql://..."`` works in any kombu or Celery app, and one alias
per ``sqlinbox+<dialect>[+<driver>]`` scheme: kombu's failover (``switch()``) takes an
alternate URL's whole scheme as the transport's name.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from . import worker as _worker  # noqa: F401  (a worker's start-up settings)
from .dialects import url_schemes
from .errors import ConfigurationError, MessageTooLarge, SchemaMismatch, SqlInboxError
from .tables import Column, InboxTable, Role, RowTask, TableBuilder, TableSpec, default_table

for _scheme in ("", *(f"+{name}" for name in url_schemes())):
    TRANSPORT_ALIASES.setdefault(f"sqlinbox{_scheme}", "kombu_sqlinbox.transport:Transport")

__version__ = "0.2.0"
__all__ = [
    "Column",
    "ConfigurationError",
    "InboxTable",
    "MessageTooLarge",
    "Role",
    "RowTask",
    "SchemaMismatch",
    "SqlInboxError",
    "TableBuilder",
    "TableSpec",
    "default_table",
]
