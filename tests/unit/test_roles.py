"""The declaration machinery both the inbox and the outbox tables use, on a kind of
table of its own: what a kind brings (roles, required roles, flags, wording) is all
that changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import pytest

from celery_ext.declaration import OutboxColumnSpec, OutboxSpec, OutboxTableBuilder
from kombu_sqlinbox.errors import ConfigurationError
from kombu_sqlinbox.roles import (
    RoleAttribute,
    RoleColumn,
    RoleTable,
    RoleTableBuilder,
    check_identifier,
)
from kombu_sqlinbox.tables import ColumnSpec, TableBuilder, TableSpec


class Part(str, Enum):
    KEY = "key"
    VALUE = "value"
    NOTE = "note"


@dataclass(frozen=True)
class PartColumn(RoleColumn[Part]):
    """A kind's column: which role each flag fits; the default wording."""

    flags = {"generated": (Part.KEY, "only the key is generated")}


@dataclass(frozen=True)
class Ledger(RoleTable[Part, PartColumn]):
    """A kind's table: its wording and its required roles; the rest is generic."""

    kind = "ledger "
    required = (Part.KEY, Part.VALUE)


class PartAttribute(RoleAttribute[PartColumn]):
    column_type = PartColumn

    def __init__(self, role: Part | str, *, name: str | None = None,
                 generated: bool = False) -> None:
        super().__init__(Part(role), name, generated=generated)


class LedgerBuilder(RoleTableBuilder[PartColumn, Ledger]):
    column_type = PartColumn
    spec_type = Ledger

    def key(self, name: str = "key") -> LedgerBuilder:
        return self._add(name, Part.KEY, generated=True)

    def value(self, name: str = "value") -> LedgerBuilder:
        return self._add(name, Part.VALUE)

    def note(self, name: str = "note") -> LedgerBuilder:
        return self._add(name, Part.NOTE)


class Declared:
    value = PartAttribute(Part.VALUE, name="amount")
    key = PartAttribute("key", generated=True)
    unrelated = "not a column"


def test_the_class_form_and_the_builder_give_equal_declarations() -> None:
    spec = Ledger("ledger", PartAttribute.collect(Declared), "books")
    built = LedgerBuilder("ledger", schema="books").value("amount").key().build()
    assert spec == built and hash(spec) == hash(built)


def test_attributes_are_collected_in_the_order_written_and_named_after_themselves() -> None:
    assert PartAttribute.collect(Declared) == (
        PartColumn("amount", Part.VALUE), PartColumn("key", Part.KEY, generated=True))


def test_a_declaration_answers_by_role() -> None:
    spec = LedgerBuilder("ledger").key("k").value().build()
    assert spec.column(Part.KEY) == PartColumn("k", Part.KEY, generated=True)
    assert spec.column(Part.NOTE) is None
    assert spec.has(Part.VALUE) and not spec.has(Part.NOTE)
    assert spec.name_of(Part.KEY) == "k"


@pytest.mark.parametrize("build, message", [
    (lambda: LedgerBuilder("ledger").note().build(),
     "ledger table 'ledger': declare a column for each of the roles key, value"),
    (lambda: LedgerBuilder("ledger").key().value().value("v2").build(),
     "ledger table 'ledger': role value is declared twice"),
    (lambda: LedgerBuilder("ledger").key("x").value("x").build(),
     "ledger table 'ledger': column 'x' has two roles"),
    (lambda: LedgerBuilder("led ger").key().value().build(),
     "ledger table 'led ger' is not a valid identifier"),
    (lambda: LedgerBuilder("ledger", schema="1books").key().value().build(),
     "ledger schema '1books' is not a valid identifier"),
    (lambda: PartColumn("no;te", Part.NOTE),
     "column for role note 'no;te' is not a valid identifier"),
    (lambda: PartColumn("note", Part.NOTE, generated=True),
     "column 'note': only the key is generated"),
])
def test_every_kind_is_checked_alike_in_its_own_words(
        build: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        build()
    assert str(refused.value).startswith(message)


def test_a_builder_judges_the_whole_declaration_when_it_builds() -> None:
    """Required roles are checked on the whole, so the builder can add them in any order."""
    builder = LedgerBuilder("ledger").value()
    with pytest.raises(ConfigurationError, match=r"roles key$"):
        builder.build()
    assert builder.key().build().required == (Part.KEY, Part.VALUE)


def test_check_identifier_returns_the_name_it_accepts() -> None:
    assert check_identifier("a" * 63, "table") == "a" * 63
    with pytest.raises(ConfigurationError, match=r"^thing 'a-b' is not a valid identifier"):
        check_identifier("a-b", "thing")


def test_the_inbox_and_the_outbox_share_the_machinery() -> None:
    assert issubclass(TableSpec, RoleTable) and issubclass(OutboxSpec, RoleTable)
    assert issubclass(ColumnSpec, RoleColumn) and issubclass(OutboxColumnSpec, RoleColumn)
    assert issubclass(TableBuilder, RoleTableBuilder)
    assert issubclass(OutboxTableBuilder, RoleTableBuilder)
