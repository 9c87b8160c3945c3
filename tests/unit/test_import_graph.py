"""The import graph of ``kombu_sqlinbox`` and ``celery_ext``: no cycle, layers one way, no
module over the length a reader takes in at once.

Every import statement counts wherever it stands: at module level, inside a function
(a lazy import that breaks a cycle at run time leaves it in the design), under
``if TYPE_CHECKING:`` (a type names the module it comes from). What does not count is the
package ``__init__`` that Python runs before a submodule it imports: a package that
gathers its modules' names would otherwise form a cycle with each of them.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import pytest

import celery_ext
import kombu_sqlinbox

ROOT = Path(kombu_sqlinbox.__file__).parent.parent
PACKAGES = (Path(kombu_sqlinbox.__file__).parent, Path(celery_ext.__file__).parent)
#: the longest a module may be
MAX_LINES = 500
#: modules allowed over MAX_LINES (path from the repository root), each with its reason;
#: an entry that no longer needs its place fails the test, to be taken out
LONG_MODULES: dict[str, str] = {}
#: what the dialects build on only from below: a dialect importing one of these (or a
#: module of it), directly or through others, would run the layers backwards
ABOVE_DIALECTS = ("transport", "channel", "operations", "deliveries", "polling", "brokers",
                  "broker", "claims", "routing", "transient", "keeper", "wakeups",
                  "own_session", "database")


def modules() -> dict[str, Path]:
    """Every module of the two packages by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imports(name: str, source: str, known: Collection[str], package: bool = False) -> set[str]:
    """The ``known`` modules that module ``name`` (a package's ``__init__`` if ``package``)
    imports anywhere in its ``source``."""
    here = name.split(".") if package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*here[: len(here) - node.level + 1], *(node.module or "").split(".")]
                            if node.level else [node.module or ""]).strip(".")
            for alias in node.names:  # a submodule by its name, else a name in ``base``
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {module for module in found if module in known and module != name}


Graph = Mapping[str, Collection[str]]
GRAPH: Graph = {name: imports(name, path.read_text(), MODULES, path.name == "__init__.py")
                for name, path in MODULES.items()}


def cycle_from(start: str, graph: Graph = GRAPH) -> list[str] | None:
    """A chain of imports from ``start`` back to it, if there is one."""
    stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
    seen = {start}
    while stack:
        targets = stack[-1][1]
        target = next(targets, None)
        if target is None:
            stack.pop()
        elif target == start:
            return [entry for entry, _ in stack] + [start]
        elif target not in seen:
            seen.add(target)
            stack.append((target, iter(sorted(graph[target]))))
    return None


def reached(name: str) -> set[str]:
    """Every module ``name`` imports, directly or through others."""
    found: set[str] = set()
    todo = [name]
    while todo:
        for target in set(GRAPH[todo.pop()]) - found:
            found.add(target)
            todo.append(target)
    return found


SOURCE = """
from __future__ import annotations
from typing import TYPE_CHECKING
import app.plain
from . import sibling, NAME
from .sub.leaf import thing
if TYPE_CHECKING:
    from .typed import Kind

def lazily():
    from ..up import helper
"""


def test_every_kind_of_import_is_an_edge() -> None:
    """Module level, inside a function, under TYPE_CHECKING, relative and absolute; a name
    imported from a package is an edge to the package, a submodule one to the submodule;
    anything outside the known modules is no edge."""
    known = {"app", "app.plain", "app.pkg", "app.pkg.sibling", "app.pkg.sub.leaf",
             "app.pkg.typed", "app.up"}
    assert imports("app.pkg.mod", SOURCE, known) == {
        "app.plain", "app.pkg.sibling", "app.pkg", "app.pkg.sub.leaf", "app.pkg.typed",
        "app.up"}
    assert imports("app.pkg", "from . import sibling", known, package=True) == {
        "app.pkg.sibling"}


def test_a_cycle_is_found_however_long() -> None:
    graph = {"a": ["b"], "b": ["c", "d"], "c": [], "d": ["a"], "e": ["a"]}
    assert cycle_from("a", graph) == ["a", "b", "d", "a"]
    assert cycle_from("e", graph) is None  # it reaches a cycle, but is in none


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_itself_back(name: str) -> None:
    cycle = cycle_from(name)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_kombu_sqlinbox_never_imports_celery_ext() -> None:
    upward = {name: sorted(target for target in targets if target.startswith("celery_ext"))
              for name, targets in GRAPH.items() if name.startswith("kombu_sqlinbox")}
    assert not {name: targets for name, targets in upward.items() if targets}


@pytest.mark.parametrize("name", sorted(name for name in MODULES
                                        if name.startswith("kombu_sqlinbox.dialects")))
def test_dialects_never_reach_the_layers_above_them(name: str) -> None:
    above = tuple(f"kombu_sqlinbox.{module}" for module in ABOVE_DIALECTS)
    reaching = sorted(target for target in reached(name)
                      if target in above or target.startswith(tuple(f"{a}." for a in above)))
    assert not reaching, f"{name} imports, directly or through others: {reaching}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_the_length_limit_unless_listed(name: str) -> None:
    path = MODULES[name].relative_to(ROOT).as_posix()
    lines = len(MODULES[name].read_text().splitlines())
    if path in LONG_MODULES:
        assert lines > MAX_LINES, (
            f"{path} is {lines} lines now: take it out of LONG_MODULES")
    else:
        assert lines <= MAX_LINES, (
            f"{path} is {lines} lines, over {MAX_LINES}: split it by job, or list it in "
            "LONG_MODULES with the reason it must be one module")


def test_every_long_module_listed_exists() -> None:
    listed = {path.relative_to(ROOT).as_posix() for path in MODULES.values()}
    assert not set(LONG_MODULES) - listed, "LONG_MODULES names a module that is gone"
