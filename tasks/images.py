"""One Flyte ImageSpec per kind of stage; `containers/` holds the equivalent Dockerfiles.

    CPU_IMAGE    resolve_config, curate, register   pyproject deps, CPU torch wheel
    TRAIN_IMAGE  rollout_and_train                  CUDA torch + vLLM (rollouts) + accelerate
    EVAL_IMAGE   validate, evaluate                 TRAIN_IMAGE's packages + bfcl-eval

Requirements come from `tasks/image_requirements.py` (i.e. from pyproject.toml, or the installed
metadata without it); the sources (`SOURCES`: envace_core/, tasks/, workflows/, pyproject.toml,
README.md, and .dvc/config so curate DVC-tracks the data in a pod without .git) are copied into /root and envace is installed with `--no-deps` after the requirements, so a
code change rebuilds only the last layers. The task modules are in the image, so registration without
fast-register (`pyflyte register --copy none`) works as well as the default fast registration.
`envace_core/BUILD_INFO.json` (commit, dirty flag, commit date; format: `envace_core.buildinfo`) is
written in the image at build time from the checkout being registered, so a pod's lineage names
its commit.

Images are built only when a task is serialised for a cluster (`pyflyte register`, `pyflyte package`,
`pyflyte run --remote`), from the repository root (flytekit's builder copies relative paths); a local
`pyflyte run` never builds, pulls or names an image.

The tag (`EnvaceImageSpec.tag`) is flytekit's spec hash with the copied sources hashed without
`__pycache__/` and `*.pyc` (flytekit's own digest of `copy` includes them, so the tag changed with
every import). `source_copy_mode` is NO_COPY, so flytekit does not add the loaded modules to the
image (and to its tag) on non-fast registration: `image_name()` here, `pyflyte register --copy none`,
`--copy auto` and `pyflyte package` all name the same image.

Run as a module from the repository root, it prints what packaging needs where no Docker daemon can
check the registry (flytekit 1.16's `ImageSpec.exist()` asks a registry other than Docker Hub only
through the local Docker daemon):

    python -m tasks.images --image-flags   # --image <ImageSpec.id>=<registry/name:tag> per image
    python -m tasks.images --names         # registry/name:tag per image, one a line

Both depend on the commit and the working tree (the tag hashes the sources and BUILD_INFO.json).

Environment variables, read when this module is imported (i.e. at registration):
  ENVACE_IMAGE_REGISTRY    registry to push to and pull from, e.g. `ghcr.io/acme` (`localhost:30000`
                           on the Flyte sandbox): HOST[:PORT][/PATH], no scheme, no trailing `/`
                           (flytekit's `validate_container_registry_name`; ImageSettingsError at import
                           otherwise). Required to serialise a task for a cluster: `image_name()`
                           raises ImageSettingsError without it.
  ENVACE_CPU_BASE_IMAGE    base of CPU_IMAGE (default `debian:bookworm-slim`)
  ENVACE_CUDA_BASE_IMAGE   base of TRAIN_IMAGE/EVAL_IMAGE (default `nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04`)
  ENVACE_IMAGE_TAG_SUFFIX  appended to the content-hash tag, e.g. `-rc1` (default none)
  FLYTE_IMG_FAST_FAIL      flytekit's: set to TRUE here unless already set, so a registration whose
                           registry cannot be checked (unreachable, no permission) fails instead of
                           assuming the image exists; FALSE restores flytekit's assumption.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import subprocess
from functools import cached_property
from pathlib import Path

from flytekit import ImageSpec
from flytekit.constants import CopyFileDetection
from flytekit.image_spec.image_spec import FLYTE_IMG_FAST_FAIL, validate_container_registry_name
from flytekit.tools.fast_registration import compute_digest

from envace_core import EnvaceError
from envace_core.buildinfo import build_info
from tasks.image_requirements import NO_DEPS, TORCH_CPU_INDEX, requirements

os.environ.setdefault(FLYTE_IMG_FAST_FAIL, "TRUE")  # read by ImageSpec.__post_init__

REPO = Path(__file__).resolve().parent.parent
PYTHON_VERSION = "3.11"
DEFAULT_CPU_BASE = "debian:bookworm-slim"
# torch and vLLM wheels ship their own CUDA user-space libraries; the base adds cuDNN/CUDA runtime
# for tools outside Python. The node's driver must support the CUDA version of the torch wheel.
DEFAULT_CUDA_BASE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
# Copied into /root (relative to the repository root); envace is installed from them without dependencies.
SOURCES = ["pyproject.toml", "README.md", "envace_core", "tasks", "workflows", ".dvc/config"]
BUILD_INFO = "envace_core/BUILD_INFO.json"


class ImageSettingsError(EnvaceError):
    """An image cannot be named or built as configured (no registry, wrong directory); the message
    names the setting."""


def _not_source(rel_path: str) -> bool:
    """True for what the tag must not hash: bytecode caches and a locally written BUILD_INFO.json."""
    p = Path(rel_path)
    return "__pycache__" in p.parts or p.suffix in (".pyc", ".pyo") or p.name == "BUILD_INFO.json"


def source_digest(root: Path = REPO, sources: list[str] = SOURCES) -> str:
    """md5 (hex) of the copied sources under `root`, as flytekit's `compute_digest` (file bytes and
    paths relative to each copied folder), without `_not_source` files."""
    return compute_digest([str(root / s) for s in sources], _not_source)


class EnvaceImageSpec(ImageSpec):
    """flytekit's ImageSpec with a tag that ignores bytecode caches and a required registry."""

    @cached_property
    def tag(self) -> str:
        """flytekit's tag of this spec without `copy`, combined with `source_digest` of `copy`."""
        base = ImageSpec.tag.func(dataclasses.replace(self, copy=None, tag_format=None))
        digest = hashlib.md5(f"{base}\0{source_digest(REPO, self.copy or [])}".encode()).digest()
        tag = base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=").replace("-", "_")
        return self.tag_format.format(spec_hash=tag) if self.tag_format else tag

    def image_name(self) -> str:
        """`registry/name:tag`. Raises ImageSettingsError without a registry (a pod could not pull
        the image) or when not run from the repository root (flytekit's builder copies relative paths)."""
        if not self.registry:
            raise ImageSettingsError(
                f"image {self.name}: ENVACE_IMAGE_REGISTRY is not set. Serialising a task for a cluster "
                "(pyflyte register / package / run --remote) needs the registry its pods pull from, e.g. "
                "ENVACE_IMAGE_REGISTRY=ghcr.io/acme (localhost:30000 on the Flyte sandbox); a local "
                "pyflyte run needs none")
        if Path.cwd().resolve() != REPO:
            raise ImageSettingsError(f"image {self.name}: run pyflyte from the repository root {REPO} "
                                     f"(the image copies {', '.join(SOURCES)} relative to it), not {Path.cwd()}")
        return super().image_name()


def _commit_date() -> str | None:
    try:
        return subprocess.run(["git", "show", "-s", "--format=%cI", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_stamp() -> dict | None:
    """The BUILD_INFO.json the image gets: {"commit", "dirty", "source_date"} of the checkout (or of
    the BUILD_INFO.json already there, inside an image), None when no commit is known."""
    info = build_info()
    if info["commit"] is None:
        return None
    date = info["source_date"] or (_commit_date() if info["commit_source"] == "git" else None)
    return {"commit": info["commit"], "dirty": info["dirty"], "source_date": date}


def build_commands(kind: str, stamp: dict | None) -> list[str]:
    """Build commands: drop copied bytecode caches, write BUILD_INFO.json (`stamp`), install envace
    from the copied sources, then the --no-deps packages of `kind`."""
    import json

    cmds = ["find /root/envace_core /root/tasks /root/workflows -name __pycache__ -prune -exec rm -rf {} +"]
    if stamp is not None:  # the JSON holds hex, ISO dates and booleans only: safe inside single quotes
        cmds.append(f"printf '%s\\n' '{json.dumps(stamp, sort_keys=True)}' > /root/{BUILD_INFO}")
    return [*cmds, "uv pip install --no-deps /root", "uv pip install --no-deps " + " ".join(NO_DEPS[kind])]


def image_registry(env: dict[str, str]) -> str | None:
    """ENVACE_IMAGE_REGISTRY of `env` (None when unset or blank). Raises ImageSettingsError for a
    value flytekit's ImageSpec refuses (`validate_container_registry_name`: HOST[:PORT][/PATH],
    lowercased; no `https://`, no trailing `/`)."""
    raw = env.get("ENVACE_IMAGE_REGISTRY", "").strip()
    if not raw:
        return None
    if not validate_container_registry_name(raw.lower()):
        raise ImageSettingsError(
            f"ENVACE_IMAGE_REGISTRY={raw!r} is not a container registry name: expected HOST[:PORT][/PATH] "
            "without a scheme or a trailing '/', e.g. ghcr.io/acme, 123456789012.dkr.ecr.us-east-1.amazonaws.com, "
            "localhost:30000 (the Flyte sandbox); unset it for a local pyflyte run")
    return raw


def image_spec(kind: str, env: dict[str, str] | None = None, stamp: dict | None = None) -> EnvaceImageSpec:
    """The ImageSpec of image `kind` ("cpu", "train-cuda", "eval-cuda") under environment `env`,
    writing BUILD_INFO.json `stamp` (None: none).

    Cheap (no build, no network): flytekit only builds when the task is serialised for a cluster.
    Raises ImageSettingsError for a malformed ENVACE_IMAGE_REGISTRY (`image_registry`).
    """
    env = os.environ if env is None else env
    cuda = kind != "cpu"
    return EnvaceImageSpec(
        name=f"envace-{kind}",
        python_version=PYTHON_VERSION,
        registry=image_registry(env),
        base_image=(env.get("ENVACE_CUDA_BASE_IMAGE") or DEFAULT_CUDA_BASE) if cuda
        else (env.get("ENVACE_CPU_BASE_IMAGE") or DEFAULT_CPU_BASE),
        packages=requirements(kind),
        # The CPU index comes first for uv; best-match still takes everything else from PyPI.
        pip_extra_index_url=None if cuda else [TORCH_CPU_INDEX],
        pip_extra_args=None if cuda else "--index-strategy unsafe-best-match",
        # Triton (under torch.compile and vLLM) compiles small C launchers at run time.
        apt_packages=["gcc", "libc6-dev"] if cuda else None,
        source_copy_mode=CopyFileDetection.NO_COPY,
        copy=list(SOURCES),
        commands=build_commands(kind, stamp),
        tag_format="{spec_hash}" + env.get("ENVACE_IMAGE_TAG_SUFFIX", ""),
    )


_STAMP = source_stamp()
CPU_IMAGE = image_spec("cpu", stamp=_STAMP)
TRAIN_IMAGE = image_spec("train-cuda", stamp=_STAMP)
EVAL_IMAGE = image_spec("eval-cuda", stamp=_STAMP)
IMAGES = (CPU_IMAGE, TRAIN_IMAGE, EVAL_IMAGE)


def image_flags(specs=IMAGES) -> list[str]:
    """`pyflyte package` / `register` arguments naming each spec as a prebuilt image:
    ["--image", "<ImageSpec.id>=<image_name()>", ...] (flytekit's ImageConfig lookup by id, which
    skips `ImageSpec.exist()` and the build). Raises ImageSettingsError as `image_name()` does."""
    return [a for i in specs for a in ("--image", f"{i.id}={i.image_name()}")]


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.images --image-flags | --names`: print `image_flags()` on one line, or the
    image names one a line. Exit status 2 with the message on stderr for an ImageSettingsError."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m tasks.images", description=main.__doc__)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--image-flags", action="store_true",
                      help="--image <ImageSpec id>=<registry/name:tag> for each image (pyflyte package/register)")
    what.add_argument("--names", action="store_true", help="registry/name:tag of each image, one a line")
    args = parser.parse_args(argv)
    try:
        print(" ".join(image_flags(IMAGES)) if args.image_flags else "\n".join(i.image_name() for i in IMAGES))
    except ImageSettingsError as e:
        print(f"ImageSettingsError: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
