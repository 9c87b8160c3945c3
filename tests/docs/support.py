"""Loading the example apps by path: they are files for readers, not an importable package."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.processes import ROOT

EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"


def load_example(relative: str) -> ModuleType:
    """A fresh module object from ``examples/<relative>``, named by its file as a worker
    started in that directory names it (Celery task names derive from it)."""
    path = EXAMPLES / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
