"""The training processes of tests/test_checkpoint_crash.py, run as
``python -m tests.checkpoint_crash_driver JOB.json``.

After one import of the training stack and one uninterrupted run (`stages.train.rollout_and_train`
with `crash_config`, counting the steps of its checkpoint writes with `crash_points`: the
reference, which also warms every lazy import), for each kill (w, k) of `crash_cases` (every step
of the last checkpoint write, the distinct steps of the earlier one) it forks a training process that SIGKILLs itself right after that step, records what the kill left in
its store, then forks the same command again (the re-run) and records what it printed and its
metrics. The cases run in CRASH_LANES (default 2) forked lanes side by side. Writes the job's "out" JSON: {"run_id", "history" (the reference's), "writes" (step labels
per write), "results": [{"kill": [w, k], "status" ("SIGKILL" or "exit <n>"), "after_kill",
"said", "history", "after_rerun"}]}.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def commit_step(steps: list[str]) -> int:
    """The one atomic commit of a write: the pointer created (first write) or swapped (later ones)."""
    return next(i for i, s in enumerate(steps, 1) if s.startswith("replace(") or s.endswith(", checkpoint)"))


def crash_cases(writes: list[list[str]]) -> list[tuple[int, int]]:
    """The (write w, step k) kills: every step k = 0..len of the last write (its files copied into a
    fresh version folder while an older checkpoint exists, the pointer swap, the old version's
    removal), and of the earlier writes the steps that differ in kind: k = 0, the commit's step and
    the one before it (a complete version without its pointer), and the last. The earlier writes'
    other steps are file copies into a fresh version folder, which the last write's cover."""
    out = []
    for w, steps in enumerate(writes, 1):
        if w == len(writes):
            ks = range(len(steps) + 1)
        else:
            c = commit_step(steps)
            ks = sorted({0, c - 1, c, len(steps)})
        out += [(w, k) for k in ks]
    return out


def crash_config(model_dir, store_root, registry):
    """The tiny run: 2 tasks, 1 per iteration, 2 iterations, a checkpoint after each."""
    from envace_core.config import load_config

    return load_config("test", {
        "model": {"ref": str(model_dir), "compute_dtype": "float32"},
        "data": {"max_train_tasks_per_domain": 2},
        "rollout": {"tasks_per_iteration": 1, "group_size": 2, "max_new_tokens_act": 6},
        "train": {"iterations": 2, "checkpoint_every": 1, "ppo_epochs": 2, "mini_batch_rows": 2,
                  "lr_scheduler": "cosine", "learning_rate": 1e-2, "micro_batch_rows": 2},
        "store": {"root": str(store_root), "registry": str(registry)}})


def store_state(run_dir: Path) -> dict:
    """What a checkpoint key and its hidden siblings hold: the iteration the key names (None: no
    checkpoint), its pointer target, the sibling names, and the iterations of the complete ones."""
    ckpt = run_dir / "checkpoint"
    siblings = sorted(p for p in run_dir.iterdir() if p.name.startswith(".checkpoint.")) if run_dir.is_dir() else []
    complete = [json.loads((p / "state.json").read_text())["iteration"] for p in siblings
                if (p / "CHECKSUMS.json").is_file() and (p / "state.json").is_file() and not p.is_symlink()]
    return {"iteration": json.loads((ckpt / "state.json").read_text())["iteration"]
            if (ckpt / "state.json").is_file() else None,
            "pointer": os.readlink(ckpt) if ckpt.is_symlink() else None,
            "siblings": [p.name for p in siblings], "complete_siblings": complete}


def _in_child(fn) -> int:
    """Run `fn()` in a forked process; its wait status."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        os._exit(code)
    return os.waitpid(pid, 0)[1]


def main(job_path: str) -> None:
    import envace_core.training.grpo as grpo
    from envace_core.stages.train import rollout_and_train
    from tests import crash_points
    from tests.test_resume import _pseudo_rewards

    job = json.loads(Path(job_path).read_text())
    tmp = Path(job["cwd"])
    os.chdir(tmp)
    # varied rewards (as in tests/test_resume.py), so the compared metrics depend on the weights
    grpo.ADVANTAGE_ESTIMATORS["role_wise"] = _pseudo_rewards(grpo.ADVANTAGE_ESTIMATORS["role_wise"])

    def cfg(store: str):
        return crash_config(job["model"], tmp / store, tmp / "registry")

    saved = crash_points.install()
    full = rollout_and_train(cfg("full"), job["dataset"])
    crash_points.uninstall(saved)
    writes = [list(w) for w in crash_points.WRITES]
    cases = crash_cases(writes)

    def one_case(w: int, k: int) -> dict:
        store = f"w{w}-k{k}"
        run_dir = tmp / store / "runs" / full["run_id"]

        def killed():
            crash_points.install(kill=(w, k))
            rollout_and_train(cfg(store), job["dataset"])

        t0 = time.perf_counter()
        status = _in_child(killed)
        rec = {"kill": [w, k], "after_kill": store_state(run_dir),
               "status": "SIGKILL" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
               else f"exit {os.waitstatus_to_exitcode(status)}"}

        def rerun():
            said = io.StringIO()
            with contextlib.redirect_stdout(said):
                out = rollout_and_train(cfg(store), job["dataset"])
            (tmp / f"{store}.json").write_text(json.dumps({"said": said.getvalue(), "history": out["history"]}))

        rec["rerun_status"] = os.waitstatus_to_exitcode(_in_child(rerun))
        if rec["rerun_status"] == 0:
            rec.update(json.loads((tmp / f"{store}.json").read_text()))
        rec["after_rerun"] = store_state(run_dir)
        rec["seconds"] = time.perf_counter() - t0
        return rec

    # Cases are independent (each its own store): LANES forked lanes (one per core, one OpenMP
    # thread each) run them side by side, each lane forking its kill and re-run processes in turn.
    lanes = max(1, int(os.environ.get("CRASH_LANES", "2")))

    def lane(i: int) -> None:
        (tmp / f"lane{i}.json").write_text(json.dumps([one_case(w, k) for w, k in cases[i::lanes]], default=str))

    pids = []
    for i in range(lanes):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                lane(i)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 3
            sys.stdout.flush()
            os._exit(code)
        pids.append(pid)
    failed = [i for i, pid in enumerate(pids) if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    if failed:
        raise RuntimeError(f"crash-test lane(s) {failed} failed (traceback above)")
    results = sorted((r for i in range(lanes) for r in json.loads((tmp / f"lane{i}.json").read_text())),
                     key=lambda r: r["kill"])
    Path(job["out"]).write_text(json.dumps({"run_id": full["run_id"], "history": full["history"],
                                            "writes": writes, "results": results}, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
