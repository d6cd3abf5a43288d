"""One Flyte ImageSpec per kind of stage; `containers/` holds the equivalent Dockerfiles.

    CPU_IMAGE    resolve_config, curate, register   pyproject deps, CPU torch wheel
    TRAIN_IMAGE  rollout_and_train                  CUDA torch + vLLM (rollouts) + accelerate
    EVAL_IMAGE   validate, evaluate                 TRAIN_IMAGE's packages + bfcl-eval

Requirements come from `tasks/image_requirements.py` (i.e. from pyproject.toml); envace itself is
copied in and installed with `--no-deps` after them, so a code change rebuilds only the last layer.
Images are built only when a task is registered or run with `--remote` (`pyflyte register`,
`pyflyte run --remote`), from the repository root (the copied paths are relative to it); a local
`pyflyte run` never builds or pulls anything.

Environment variables, read when this module is imported (i.e. at registration):
  ENVACE_IMAGE_REGISTRY    registry to push to (default `localhost:30000`, the Flyte sandbox's)
  ENVACE_CPU_BASE_IMAGE    base of CPU_IMAGE (default `debian:bookworm-slim`)
  ENVACE_CUDA_BASE_IMAGE   base of TRAIN_IMAGE/EVAL_IMAGE (default `nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04`)
  ENVACE_IMAGE_TAG_SUFFIX  appended to the content-hash tag, e.g. `-rc1` (default none)
"""

from __future__ import annotations

import os

from flytekit import ImageSpec

from tasks.image_requirements import NO_DEPS, TORCH_CPU_INDEX, requirements

PYTHON_VERSION = "3.11"
DEFAULT_REGISTRY = "localhost:30000"
DEFAULT_CPU_BASE = "debian:bookworm-slim"
# torch and vLLM wheels ship their own CUDA user-space libraries; the base adds cuDNN/CUDA runtime
# for tools outside Python. The node's driver must support the CUDA version of the torch wheel.
DEFAULT_CUDA_BASE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
# Copied into /root (relative to the repository root) and installed without dependencies.
PACKAGE_FILES = ["pyproject.toml", "README.md", "envace_core"]


def _install_envace(kind: str) -> list[str]:
    """Build commands: envace from the copied sources, then the --no-deps packages of `kind`."""
    return ["uv pip install --no-deps /root", "uv pip install --no-deps " + " ".join(NO_DEPS[kind])]


def image_spec(kind: str, env: dict[str, str] | None = None) -> ImageSpec:
    """The ImageSpec of image `kind` ("cpu", "train-cuda", "eval-cuda") under environment `env`.

    Cheap (no build, no network): flytekit only builds when the task is serialised for a cluster.
    """
    env = os.environ if env is None else env
    cuda = kind != "cpu"
    return ImageSpec(
        name=f"envace-{kind}",
        python_version=PYTHON_VERSION,
        registry=env.get("ENVACE_IMAGE_REGISTRY") or DEFAULT_REGISTRY,
        base_image=(env.get("ENVACE_CUDA_BASE_IMAGE") or DEFAULT_CUDA_BASE) if cuda
        else (env.get("ENVACE_CPU_BASE_IMAGE") or DEFAULT_CPU_BASE),
        packages=requirements(kind),
        # The CPU index comes first for uv; best-match still takes everything else from PyPI.
        pip_extra_index_url=None if cuda else [TORCH_CPU_INDEX],
        pip_extra_args=None if cuda else "--index-strategy unsafe-best-match",
        # Triton (under torch.compile and vLLM) compiles small C launchers at run time.
        apt_packages=["gcc", "libc6-dev"] if cuda else None,
        copy=PACKAGE_FILES,
        commands=_install_envace(kind),
        tag_format="{spec_hash}" + env.get("ENVACE_IMAGE_TAG_SUFFIX", ""),
    )


CPU_IMAGE = image_spec("cpu")
TRAIN_IMAGE = image_spec("train-cuda")
EVAL_IMAGE = image_spec("eval-cuda")
