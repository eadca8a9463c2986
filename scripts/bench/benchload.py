"""Load a sibling bench script (``scripts/bench/<name>.py``) as a module, for the scripts that
reuse another's pieces (``classify_learned.py`` and ``scripts/corpus-nearest`` read
``classify.py``'s corpus). The tests have their own loader (``tests/bench_script.py``): they
never import from ``scripts/``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def load_bench(name: str) -> ModuleType:
    """``scripts/bench/<name>.py`` run as the module ``bench_<name>`` (registered in
    ``sys.modules``: a dataclass looks its module up by name); loaded once per process."""
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
