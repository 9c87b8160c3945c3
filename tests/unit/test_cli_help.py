"""Every command's ``--help`` reads as plain text: the reStructuredText markup the
docstrings use for Sphinx (double backticks, roles) is not shown to a terminal user."""

from __future__ import annotations

import re
from collections.abc import Iterator

import click
import pytest

from celery_ext.ops_cli import sqlinbox
from celery_ext.outbox_cli import outbox

MARKUP = re.compile(r"``|:(?:class|func|meth|mod|data|attr|doc|ref|exc):`")


def helps(command: click.Command, path: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """Each command's name and ``--help`` text, its sub-commands' too."""
    yield " ".join(path), command.get_help(click.Context(command, info_name=" ".join(path)))
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from helps(sub, (*path, name))


ALL_HELP = [*helps(sqlinbox, ("sqlinbox",)), *helps(outbox, ("outbox",))]


def test_every_command_is_walked() -> None:
    names = {name for name, _ in ALL_HELP}
    assert {"sqlinbox", "sqlinbox queues", "outbox"} <= names
    assert len(names) > 10


@pytest.mark.parametrize(("name", "text"), ALL_HELP, ids=[name for name, _ in ALL_HELP])
def test_help_has_no_restructuredtext_markup(name: str, text: str) -> None:
    marked = [line.strip() for line in text.splitlines() if MARKUP.search(line)]
    assert not marked, f"{name} --help shows markup: {marked}"
