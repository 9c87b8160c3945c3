"""The core modules depend one way: transport and channel (operations beside them), the
deliveries, broker, claims, database, dialects, codec, rows. Each is built and tested on
the ones below it; none imports one above (not even for type checking), which would
bring the cycle back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kombu_sqlinbox

PACKAGE = Path(kombu_sqlinbox.__file__).parent
#: from the top down
LAYERS = (
    ("transport", "channel", "browsing", "limit_figures", "operations", "pause_operations"),
    ("deliveries", "polling", "brokers"),
    ("broker",),
    ("claims", "routing", "transient", "results", "unique", "pausing", "limits", "rates",
     "task_rates"),
    ("keeper", "wakeups"),
    ("own_session", "retries", "written", "lapsing"),
    ("database",),
    ("dialects", "dialects.base", "dialects.core", "dialects.driver", "dialects.selection",
     "dialects.publish", "dialects.schema", "dialects.queue", "dialects.operations",
     "dialects.routing", "dialects.pausing", "dialects.limits", "dialects.rates",
     "dialects.outbox",
     "dialects.results", "dialects.wakeups", "dialects.unique", "dialects.mysql_unique",
     "dialects.mysql", "dialects.postgresql", "dialects.sqlite", "dialects.conformance",
     "dialects.conformance.suite", "dialects.conformance.schema", "dialects.conformance.queue",
     "dialects.conformance.capabilities", "dialects.conformance.outbox",
     "dialects.conformance.operations", "dialects.conformance.clock",
     "dialects.conformance.routing"),
    ("codec",),
    ("rows",),
)


def imported(module: str) -> set[str]:
    """The package's modules (and names in them) that ``module`` imports, dotted."""
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    here = module.split(".")[:-1]
    if not path.exists():  # a package
        path = PACKAGE.joinpath(*module.split("."), "__init__.py")
        here = module.split(".")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            target = here[: len(here) - node.level + 1] + (
                node.module.split(".") if node.module else [])
        elif node.module and node.module.split(".")[0] == PACKAGE.name:
            target = node.module.split(".")[1:]
        else:
            continue
        found.add(".".join(target))
        found.update(".".join([*target, alias.name]) for alias in node.names)
    return found


@pytest.mark.parametrize("level", range(1, len(LAYERS)))
def test_no_core_module_imports_a_layer_above_it(level: int) -> None:
    above = {name for layer in LAYERS[:level] for name in layer}
    for module in LAYERS[level]:
        upward = sorted(imported(module) & above)
        assert not upward, f"{module} imports from a layer above it: {upward}"
