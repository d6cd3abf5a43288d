"""Flyte's task cache: a cache version derived from the code, and where local runs keep the cache.

Cache versions come from the code, not from a hand-bumped string: `CodeCachePolicy` hashes the
task's module source, the source of every envace_core module it can reach through imports
(function-local imports included) and the pinned requirements of its image (pyproject.toml). Change
any of them and the task's cache version changes, so Flyte (and flytekit's local cache) runs it again
instead of returning a result computed by older code.

Environment variable, read when this module is imported (every task module imports it through
`tasks.resources`):
  ENVACE_FLYTE_CACHE   flytekit's local task cache (default ./.envace/flyte-cache; local runs only)
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
from pathlib import Path
from typing import Callable, Optional

from flytekit.core.cache import VersionParameters

import envace_core
from tasks.image_requirements import project_dependencies

PACKAGE = "envace_core"
_PACKAGE_DIR = Path(envace_core.__file__).resolve().parent


def configure_local_cache(path: str | Path | None = None) -> Path:
    """Point flytekit's local task cache at `path`, $ENVACE_FLYTE_CACHE or ./.envace/flyte-cache.

    flytekit 1.16 keeps local results in a diskcache at the module constant
    `flytekit.core.local_cache.CACHE_LOCATION` (~/.flyte/local-cache, with no config knob), opened
    on first use. Keeping it beside the default artifact store (.envace/store) makes `make clean`
    drop both together, so a cached result never points at a deleted dataset or checkpoint, and
    keeps test runs out of the user's home. Nothing is created until a cached task runs.
    """
    from flytekit.core import local_cache

    target = Path(path or os.environ.get("ENVACE_FLYTE_CACHE") or Path.cwd() / ".envace" / "flyte-cache")
    target = target.expanduser().absolute()
    if local_cache.CACHE_LOCATION != str(target):
        if local_cache.LocalTaskCache._initialized:
            local_cache.LocalTaskCache._cache.close()
        local_cache.CACHE_LOCATION = str(target)
        local_cache.LocalTaskCache._initialized = False  # reopened at the new place on next use
    return target


def clear_cache_hint() -> str:
    """How to drop a stale cached result, for `envace_core.stages.inputs.fetch_inputs`' error."""
    from flytekit.core import local_cache

    return (f"clear the cache and run again: locally `rm -rf {local_cache.CACHE_LOCATION}` or "
            "`pyflyte run --overwrite-cache ...`; on a cluster, relaunch with cache overwrite")


def _module_path(name: str, package_dir: Path) -> Optional[Path]:
    base = package_dir.parent.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


# `import a.b as c, d` / `from .x import (y as z,\n w)`: statements at any indentation, so
# function-local imports count. A match inside a string only adds a candidate, never drops one.
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)"
                     r"|import[ \t]+([^\n#]*))", re.M)


def _imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """envace_core modules (and candidates `pkg.name`) imported anywhere in `source`."""
    out: set[str] = set()
    for dots, base, names, plain in _IMPORT.findall(source):
        listed = [n.split(" as ")[0].strip(" ()\\\n\t") for n in (names or plain).split(",")]
        if plain:
            out |= set(listed)
            continue
        if dots:  # relative: resolve against this module's package
            pkg = module if is_package else module.rpartition(".")[0]
            for _ in range(len(dots) - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}" if base else pkg
        out |= {base} | {f"{base}.{n}" for n in listed if n}
    return {n for n in out if n == PACKAGE or n.startswith(PACKAGE + ".")}


def reachable_sources(source: str, package_dir: Path = _PACKAGE_DIR,
                      read: Callable[[Path], str] = Path.read_text) -> dict[str, str]:
    """{module name: source} of every envace_core module reachable from `source` by imports.

    Conservative on purpose: function-local imports count, and importing `a.b.c` also runs
    `a/__init__` and `a.b/__init__`, so those count too. Over-counting costs a re-run; missing a
    module would serve results of old code.
    """
    todo = sorted(_imported_names(source, "__task__", False))
    found: dict[str, str] = {}
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            path = _module_path(mod, package_dir)
            if mod in found or path is None:
                continue
            found[mod] = read(path)
            todo += sorted(_imported_names(found[mod], mod, path.name == "__init__.py"))
    return found


def code_version(task_source: str, image_packages: Optional[list[str]] = None,
                 package_dir: Path = _PACKAGE_DIR, read: Callable[[Path], str] = Path.read_text) -> str:
    """sha256 (hex) of a task's source, the envace_core modules it reaches, and the pins it runs on.

    Stable across machines and checkouts: module names (not paths) and normalised line endings go
    into the hash, in sorted order.
    """
    h = hashlib.sha256(b"envace-cache-v1\0")
    h.update(task_source.replace("\r\n", "\n").encode())
    for name, src in sorted(reachable_sources(task_source, package_dir, read).items()):
        h.update(f"\0{name}\0".encode() + src.replace("\r\n", "\n").encode())
    h.update(json.dumps([project_dependencies(), image_packages or []]).encode())
    return h.hexdigest()


class CodeCachePolicy:
    """flytekit cache policy: the version is `code_version` of the task's module and image."""

    def get_version(self, salt: str, params: VersionParameters) -> str:
        source = inspect.getsource(inspect.getmodule(params.func))
        image = params.container_image
        packages = list(image.packages or []) if hasattr(image, "packages") else []
        return code_version(salt + source, packages)


configure_local_cache()
