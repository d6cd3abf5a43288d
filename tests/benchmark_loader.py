"""Load a script under benchmarks/ as a module, the way the tests of every benchmark need it.

Benchmark scripts are not a package (each runs as ``python benchmarks/NAME.py`` and puts its own folder on
``sys.path``), so tests load them from their file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, module_name: str | None = None, register: bool = False) -> ModuleType:
    """A fresh module object of ``benchmarks/<name>.py``, named `module_name` (default `name`); with
    `register` it is put in ``sys.modules`` under that name before it runs (dataclasses and pickling look
    their module up by name). Raises FileNotFoundError when no such script exists."""
    path = BENCH / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark script {path}")
    spec = importlib.util.spec_from_file_location(module_name or name, path)
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[module_name or name] = mod
    spec.loader.exec_module(mod)
    return mod
