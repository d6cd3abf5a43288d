"""Private Rehearsal on one tau2 task, for people to look at (`envace rehearse`, `workflows/rehearse.py`).

`rehearse_task` loads the policy, runs `rehearsal.RehearsalAgent` (rehearse N times in the head, then
commit one real execution) on one task, replay-scores the committed trajectory with tau2's evaluator,
and returns a JSON-able dict: every rehearsal (calls tried, imagined observations, how it ended,
verifier reasons when rejected, SELF-EVAL in sequential mode), the rehearsal memory per round, the
committed trajectory (calls, real observations, final message), its reward and sub-rewards, and the
isolation check (real calls during rehearsal, DB hash before rehearsal and after it). `print_result`
renders that dict in the terminal (rich) and `render_html` as HTML (the Flyte Deck).
"""

from __future__ import annotations

import html
import json
import time
from typing import Any

from envace_core import EnvaceError
from envace_core.config import RunConfig

MODES = ("none", "parallel", "sequential")
LIST_HINT = "list ids with `envace rehearse --list [DOMAIN]`"


class UnknownTaskError(EnvaceError):
    """A task id that no split of its tau2 domain holds."""


# ------------------------------------------------------------------------------------------ tasks
def task_ids(domain: str) -> dict[str, list[str]]:
    """{split: [task ids]} of a tau2 domain (every split the package defines)."""
    from envace_core.envs.tau2.tasks import load_tasks, valid_splits

    return {s: [t.id for t in load_tasks(domain, s)] for s in valid_splits(domain)}


def tasks_in_file(tasks_file: str) -> list:
    """The tasks of a tasks file (`stages.dataset.read_tasks_file`), each checked to be runnable here: its
    domain one of tau2's `DOMAINS` and its id ``<domain>/...``. Raises EnvaceError naming the first task that
    is not, or from `read_tasks_file`."""
    from envace_core.envs.tau2.tasks import DOMAINS
    from envace_core.stages.dataset import read_tasks_file

    tasks = read_tasks_file(tasks_file)
    for t in tasks:
        if t.domain not in DOMAINS:
            raise EnvaceError(f"tasks file {tasks_file}: task {t.id[:120]!r} has domain {t.domain[:60]!r}, not one of "
                              f"tau2's {', '.join(DOMAINS)}")
        if not t.id.startswith(t.domain + "/"):
            raise EnvaceError(f"tasks file {tasks_file}: task {t.id[:120]!r} of domain {t.domain!r} has an id that "
                              f"does not start with {t.domain + '/'!r}")
    return tasks


def find_task(task_id: str, tasks_file: str | None = None):
    """The tau2 `Task` with id `domain/id`, searched over all splits of the domain (test first); with
    `tasks_file` (`stages.dataset.read_tasks_file`: a curated dataset folder, its tasks.parquet, or a .json
    list of task records), searched there instead, so synthesized train and held-out tasks can be shown.

    Raises UnknownTaskError (a one-line message saying how to list ids) if there is none; EnvaceError from
    `tasks_in_file` for a tasks file that is missing, cannot be read, or holds a task of no tau2 domain.
    """
    from envace_core.envs.tau2.tasks import DOMAINS, load_tasks, valid_splits

    shown = task_id if len(task_id) <= 120 else task_id[:119] + "…"
    if tasks_file is not None:
        tasks = tasks_in_file(tasks_file)
        for t in tasks:
            if t.id == task_id:
                return t
        some = ", ".join(t.id for t in tasks[:3]) + (", ..." if len(tasks) > 3 else "")
        raise UnknownTaskError(f"unknown task id {shown!r}: the {len(tasks)} tasks of {tasks_file} do not hold it "
                               f"(they are {some or 'none'}; list them with --tasks PATH --list)")

    domain, sep, _ = task_id.partition("/")
    if not sep or domain not in DOMAINS:
        raise UnknownTaskError(f"unknown task id {shown!r}: give DOMAIN/ID with DOMAIN one of "
                               f"{', '.join(DOMAINS)} (e.g. airline/3); {LIST_HINT}")
    splits = sorted(valid_splits(domain), key=lambda s: (s != "test", s != "train", s))
    for split in splits:
        for t in load_tasks(domain, split):
            if t.id == task_id:
                return t
    raise UnknownTaskError(f"unknown task id {shown!r}: no {domain} split ({', '.join(splits)}) has it; "
                           f"{LIST_HINT}")


# ---------------------------------------------------------------------------------------- running
def check_rehearse_args(cfg: RunConfig, task_id: str | None, *, mode: str | None = None, n: int | None = None,
                        model: str | None = None, adapter: str | None = None, tasks_file: str | None = None,
                        reenter: bool = False, no_verifier: bool = False, max_turns: int | None = None,
                        task_flag: str = "--task") -> None:
    """The argument checks of one rehearsal run (`envace rehearse`, the rehearse workflow's task), made before any
    model loads; `n` and `model`, when given, are set in `cfg` (``rehearsal.n``, ``model.ref``) through the
    settings' own checks. `mode` / `n` None: the profile's ``rehearsal.mode`` / ``rehearsal.n``; `reenter` /
    `no_verifier`: whether those flags were given; `task_flag`: how the caller names the task id.

    Raises `EnvaceError` naming the flag: no task id, an unknown mode, ``n < 1``, ``max_turns < 1``, an empty
    adapter; `ConfigError` for an `n` outside the bounds of ``rehearsal.n`` (1..64) or a bad `model`;
    `evaluation.options.UnusedOptionError` for --n, --reenter or --no-verifier under rehearsal mode none (they
    would be ignored); `UnknownTaskError` / `EnvaceError` from `find_task` (an unknown id, a bad tasks file)."""
    from envace_core.config import ConfigError, apply_setting
    from envace_core.evaluation.options import UnusedOptionError

    if not (task_id or "").strip():
        raise EnvaceError(f"give the task as {task_flag} DOMAIN/ID (e.g. airline/3); {LIST_HINT}")
    if mode is not None and mode not in MODES:
        raise EnvaceError(f"--mode {mode!r}: choose one of {', '.join(MODES)} (or leave it out for the profile's "
                          f"rehearsal.mode, {cfg.rehearsal.mode})")
    if n is not None and n < 1:
        raise EnvaceError(f"--n must be >= 1, got {n}")
    if max_turns is not None and max_turns < 1:
        raise EnvaceError(f"--max-turns must be >= 1, got {max_turns}")
    if n is not None:
        apply_setting(cfg, "rehearsal.n", str(n), "--n")  # the config's bounds
    if (mode or cfg.rehearsal.mode) == "none":
        for flag, given in (("--n", n is not None), ("--reenter", reenter), ("--no-verifier", no_verifier)):
            if given:
                raise UnusedOptionError(f"{flag}: rehearsal mode none makes no rehearsal, so {flag} would be "
                                        "ignored; drop it or choose --mode parallel or sequential")
    if model is not None:
        apply_setting(cfg, "model.ref", model, "--model")
    if adapter is not None and not adapter.strip():
        raise ConfigError("--adapter is empty: give a LoRA adapter folder, or leave --adapter out")
    find_task(task_id, tasks_file)  # an unknown id or a bad tasks file fails before the model loads


def rehearse_task(cfg: RunConfig, task_id: str, mode: str | None = None, n: int | None = None, *,
                  adapter_dir: str | None = None, reenter: bool | None = None,
                  verifier: bool | None = None, max_turns: int | None = None,
                  seed: int | None = None, engine=None, tasks_file: str | None = None) -> dict[str, Any]:
    """Rehearse then commit on one task; the JSON-able result (module docstring).

    Unset options come from `cfg.rehearsal` (mode, n, reenter, verifier, memory content and budget, temperature)
    and `cfg.eval` (max_turns, committed-execution temperature); `seed` defaults to `cfg.train.seed`.
    `engine`: an already-built engine (benchmarks reuse one); default: `stages.load_policy` + HFEngine.
    `tasks_file`: where the task is looked up (`find_task`); default: the tau2 domain's own splits.
    Raises EnvaceError for an unknown task id, an unreadable tasks file, an unknown mode or n < 1.
    """
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.rehearsal import trace
    from envace_core.rehearsal.agent import RehearsalAgent
    from envace_core.rehearsal.verifier import default_checks
    from envace_core.training.loop import score
    from envace_core.training.policy import load_policy, policy_engine, rehearsal_params, rollout_params

    mode = cfg.rehearsal.mode if mode is None else mode
    n = cfg.rehearsal.n if n is None else n
    if mode not in MODES:
        raise EnvaceError(f"unknown rehearsal mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode != "none" and n < 1:
        raise EnvaceError(f"--n must be >= 1 for mode {mode!r}, got {n}")
    reenter = cfg.rehearsal.reenter if reenter is None else reenter
    verifier = cfg.rehearsal.verifier if verifier is None else verifier
    turns = max_turns or cfg.eval.max_turns
    seed = cfg.train.seed if seed is None else seed
    task = find_task(task_id, tasks_file)
    t_load = time.perf_counter()
    if engine is None:
        model, tok, _ = load_policy(cfg, adapter_dir)
        engine = policy_engine(cfg, model, tok)
    load_s = time.perf_counter() - t_load
    act = rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=turns,
                         lenient=cfg.eval.lenient_tool_format)
    reh = rehearsal_params(cfg, turns)
    agent = RehearsalAgent(engine, mode, n, cfg.rehearsal.memory_max_tokens, act, reh, seed=seed,
                           verifier=default_checks(task.domain, cfg.rehearsal.grounded_errors) if verifier else None,
                           reenter=reenter, memory_content=cfg.rehearsal.memory_content,
                           prune_rejected=cfg.rehearsal.prune_rejected)
    env = Tau2Environment(task.domain)
    env.reset(task)
    hash_before, calls_before = env.snapshot(), env.calls_made
    t0 = time.perf_counter()
    res = agent.run(task_context(task, cfg.data.policy_max_chars), env)  # IsolationError if touched
    run_s = time.perf_counter() - t0
    real_calls = env.calls_made - calls_before
    hash_after_commit = env.snapshot()
    traj = score(task, res.committed)

    rounds = trace.rounds(res.rounds)
    final = next((s.message for s in reversed(traj.steps) if s.action is None and s.message), "")
    iso = dict(res.isolation)
    iso.update({"db_hash_before_rehearsal": hash_before, "rounds_checked": len(res.rounds),
                "real_calls_committed": real_calls, "db_hash_after_commit": hash_after_commit})
    return {
        "task_id": task.id, "domain": task.domain, "split": task.split,
        "first_user_message": task.first_user_message,
        "settings": {"mode": mode, "n": n if mode != "none" else 0, "reenter": reenter,
                     "verifier": verifier, "max_turns": turns, "seed": seed,
                     "model": cfg.model.ref, "adapter": adapter_dir, "profile": cfg.profile,
                     "tasks_file": tasks_file,
                     "rehearsal_temperature": cfg.rehearsal.temperature,
                     "commit_temperature": cfg.eval.temperature},
        "rounds": rounds,
        "n_rehearsals": len(res.rehearsals), "n_rejected": len(res.rejected),
        "memory": res.memory,
        "committed": {"steps": trace.steps(traj), "final_message": final, "termination": traj.termination,
                      "parse_errors": trace.parse_errors(traj)},
        "reward": traj.reward, "sub_rewards": dict(traj.sub_rewards),
        "reward_info": json.loads(json.dumps(traj.reward_info, default=str)),
        "isolation": iso,
        "seconds": {"load": load_s, "rehearse_and_commit": run_s},
    }


# -------------------------------------------------------------------------------------- rendering
def _short(text: str | None, k: int = 300) -> str:
    text = "" if text is None else " ".join(str(text).split())
    return text if len(text) <= k else text[: k - 1] + "…"


def _step_lines(steps: list[dict[str, Any]]) -> list[str]:
    lines = []
    for s in steps:
        if "call" in s:
            args = json.dumps(s["call"]["arguments"], sort_keys=True)
            lines.append(f"call {s['call']['name']}({args})")
            lines.append(f"  -> {'ERROR ' if s['error'] else ''}{_short(s['observation'])}")
        else:
            lines.append(f"say: {_short(s['message'])}")
    return lines or ["(no step)"]


def _isolation_ok(iso: dict[str, Any]) -> bool:
    return iso.get("real_calls_during_rehearsal") == 0 and bool(iso.get("db_hash_unchanged"))


def print_result(r: dict[str, Any], console=None) -> None:
    """The result as rich panels and tables: rehearsals, memory, committed run, reward, isolation."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    c = console or Console()
    s = r["settings"]
    c.rule(f"Private Rehearsal on {r['task_id']} ({r['split']} split)")
    c.print(f"mode={s['mode']} n={s['n']} reenter={s['reenter']} verifier={s['verifier']} "
            f"max_turns={s['max_turns']} seed={s['seed']} model={s['model']}"
            + (f" adapter={s['adapter']}" if s["adapter"] else ""), markup=False)
    c.print(Panel(Text(_short(r["first_user_message"], 800)), title="user's request"))
    c.rule("Rehearsals (imagined; no real environment)")
    if not r["rounds"] or not any(rd["rehearsals"] for rd in r["rounds"]):
        c.print("(no rehearsal: mode none)")
    for rd in r["rounds"]:
        for h in rd["rehearsals"]:
            status = "REJECTED by the verifier" if h["rejected"] else "kept"
            body = _step_lines(h["steps"]) + [f"ended: {h['termination']}"]
            if h["rejected"]:
                body += [f"verifier: {reason}" for reason in h["reasons"]]
            if h["self_eval"] is not None:
                ev = h["self_eval"]
                goal = {True: "yes", False: "no", None: "unknown"}[ev["reached_goal"]]
                body.append(f"self-eval: goal reached: {goal}; blocker: {_short(ev['blocker'], 150) or '-'}; "
                            f"instead: {_short(ev['advice'], 150) or '-'}")
            body += [f"parse error: {_short(e, 150)}" for e in h["parse_errors"]]
            c.print(Panel(Text("\n".join(body)),
                          title=f"round {rd['turn']} · rehearsal {h['index']} · {status}",
                          border_style="red" if h["rejected"] else "cyan"))
    c.rule("Rehearsal memory")
    for rd in r["rounds"]:
        if len(r["rounds"]) > 1:
            c.print(f"[bold]before real step {rd['turn'] + 1}:[/bold]")
        c.print(Text(rd["memory"] or "(empty: no kept rehearsal, or none that rehearsal.memory_content keeps)"))
    c.rule("Committed execution (real environment)")
    cm = r["committed"]
    c.print(Panel(Text("\n".join(_step_lines(cm["steps"]) + [f"ended: {cm['termination']}"]
                                 + [f"parse error: {_short(e, 150)}" for e in cm["parse_errors"]])),
                  title="committed trajectory", border_style="green"))
    c.print(Panel(Text(cm["final_message"] or "(none)"), title="final message"))
    t = Table(title="tau2 reward (replay with tau2's evaluator)")
    t.add_column("reward")
    for k in r["sub_rewards"]:
        t.add_column(k)
    t.add_row("—" if r["reward"] is None else f"{r['reward']:.3f}",
              *[f"{v:.3f}" for v in r["sub_rewards"].values()])
    c.print(t)
    iso = r["isolation"]
    ok = _isolation_ok(iso)
    c.print(f"[bold {'green' if ok else 'red'}]isolation: {'OK' if ok else 'VIOLATED'}[/] "
            f"({iso.get('rounds_checked')} rehearsal round(s) checked)")
    c.print(f"  real calls during rehearsal = {iso.get('real_calls_during_rehearsal')}")
    c.print(f"  DB hash unchanged by rehearsal = {iso.get('db_hash_unchanged')}")
    c.print(f"  DB hash before rehearsal: {str(iso.get('db_hash_before_rehearsal'))[:16]}…")
    c.print(f"  real calls by the committed execution = {iso.get('real_calls_committed')}")
    c.print(f"{r['n_rehearsals']} rehearsal(s), {r['n_rejected']} rejected; "
            f"{r['seconds']['rehearse_and_commit']:.1f}s rehearse+commit, {r['seconds']['load']:.1f}s model load")


def render_html(r: dict[str, Any]) -> str:
    """A self-contained HTML page of the result (for a Flyte Deck)."""
    e = html.escape

    def pre(lines: list[str]) -> str:
        return "<pre style='white-space:pre-wrap'>" + e("\n".join(lines)) + "</pre>"

    s = r["settings"]
    parts = [f"<h2>Private Rehearsal on {e(r['task_id'])} ({e(r['split'])} split)</h2>",
             f"<p>{e(', '.join(f'{k}={v}' for k, v in s.items()))}</p>",
             "<h3>User's request</h3>", pre([r["first_user_message"]]),
             "<h3>Rehearsals (imagined)</h3>"]
    for rd in r["rounds"]:
        for h in rd["rehearsals"]:
            status = "REJECTED" if h["rejected"] else "kept"
            body = _step_lines(h["steps"]) + [f"ended: {h['termination']}"]
            body += [f"verifier: {x}" for x in h["reasons"]]
            if h["self_eval"] is not None:
                ev = h["self_eval"]
                body.append(f"self-eval: goal={ev['reached_goal']}; blocker: {ev['blocker']}; instead: {ev['advice']}")
            color = "#c00" if h["rejected"] else "#06c"
            parts.append(f"<h4 style='color:{color}'>round {rd['turn']} · rehearsal {h['index']} · {status}</h4>"
                         + pre(body))
    parts.append("<h3>Rehearsal memory</h3>")
    for rd in r["rounds"]:
        parts.append(pre([f"[round {rd['turn']}]", rd["memory"] or "(empty)"]))
    cm = r["committed"]
    parts += ["<h3>Committed execution (real environment)</h3>",
              pre(_step_lines(cm["steps"]) + [f"ended: {cm['termination']}"]),
              "<p><b>final message:</b> " + e(cm["final_message"] or "(none)") + "</p>",
              "<h3>tau2 reward</h3><table border='1'><tr><th>reward</th>"
              + "".join(f"<th>{e(k)}</th>" for k in r["sub_rewards"]) + "</tr><tr><td>"
              + e("—" if r["reward"] is None else f"{r['reward']:.3f}") + "</td>"
              + "".join(f"<td>{v:.3f}</td>" for v in r["sub_rewards"].values()) + "</tr></table>"]
    iso = r["isolation"]
    ok = _isolation_ok(iso)
    parts.append(f"<h3>Isolation: <span style='color:{'green' if ok else 'red'}'>{'OK' if ok else 'VIOLATED'}</span></h3>"
                 "<table border='1'>" + "".join(f"<tr><td>{e(k)}</td><td>{e(str(v))}</td></tr>"
                                                for k, v in iso.items()) + "</table>")
    return "<div class='envace-rehearse'>" + "".join(parts) + "</div>"
