"""The code blocks of a reStructuredText guide, read as a reader copies them: a test that
follows a guide runs what the guide says, so the two cannot part unnoticed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_DIRECTIVE = re.compile(r"^\.\. code-block:: (\w+)\s*$")


@dataclass(frozen=True)
class Command:
    """A ``$ command`` of a console block and the output the guide shows under it."""

    line: str
    output: str


def section(path: Path, title: str) -> list[str]:
    """The lines of the section titled ``title`` (up to the next title of any level)."""
    lines = path.read_text().splitlines()
    start = lines.index(title) + 2  # the title and its underline
    for at in range(start, len(lines) - 1):
        below = lines[at + 1]
        if lines[at] and below and set(below) <= set("=-~^") and len(below) >= len(lines[at]):
            return lines[start:at]
    return lines[start:]


def code_blocks(path: Path, title: str, language: str) -> list[str]:
    """The text of each ``.. code-block:: language`` in the section ``title``, dedented."""
    lines, blocks = section(path, title), []
    for at, line in enumerate(lines):
        found = _DIRECTIVE.match(line)
        if not found or found.group(1) != language:
            continue
        body: list[str] = []
        for text in lines[at + 1:]:
            if text and not text.startswith(" "):
                break
            body.append(text)
        indent = min(len(text) - len(text.lstrip()) for text in body if text.strip())
        blocks.append("\n".join(text[indent:] for text in body).strip("\n") + "\n")
    return blocks


def commands(block: str) -> list[Command]:
    """The ``$ `` commands of a console block, each with the lines shown under it."""
    found: list[Command] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            found.append(Command(line[2:], ""))
        elif found:
            found[-1] = Command(found[-1].line, found[-1].output + line + "\n")
    return found
