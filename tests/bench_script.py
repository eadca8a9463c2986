"""Load a bench script (``scripts/bench/<name>.py``) as a module, for the tests of its pieces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_bench(name: str) -> ModuleType:
    """``scripts/bench/<name>.py`` run as the module ``bench_<name>`` (registered in
    ``sys.modules``: a dataclass looks its module up by name)."""
    path = REPO / "scripts" / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
