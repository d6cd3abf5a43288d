"""The one tau2-bench evaluation harness: tasks × trials under a named protocol, scored by tau2's evaluator.

`run_tau2` is what the main job's evaluate stage, `envace eval` (`evaluation.harness`), tool learning's
measurement (`tool_learning.measure`) and the benchmarks run; the protocol (`evaluation.protocols`:
``tau2_orchestrator`` = tau2's own Orchestrator with a simulated user, ``opening_request`` = the opening
request only, no user simulator) is an argument and every record names it.

* The agent of (task, trial) is ``agent_for(domain, seed + trial)``, a `RehearsalAgent` (`policy_agent`
  builds it from the run configuration; mode "none" = plain ACT). Under ``tau2_orchestrator`` it plays
  `tau2_agents.EnvaceTau2Agent` inside tau2's ``Orchestrator`` (as ``tau2.run.run_task`` builds it) with
  `tau2_agents.EnvaceUserSimulator` as the user; the simulation is scored by `score_simulation`.
  Under ``opening_request`` it runs against a private `Tau2Environment` reset to the task
  (`RehearsalAgent.run`: rehearse, then commit; with mode "none" only the committed `real_rollout`) and
  the trajectory is scored by the replay reward (`training.rewards.score_trajectory`, tau2's evaluator).
* A record (one per (task, trial)): protocol, domain, task_id (our `Task.id`, "airline/19"), trial, seed,
  reward (None = unscored), success (tau2's ``is_successful``; None when unscored), reward_breakdown,
  db_match, termination_reason (tau2_orchestrator: tau2's ``TerminationReason`` value, e.g. user_stop,
  max_steps; opening_request: agent_message, parse_error, max_turns; "error" when the trial raised),
  nl_assertions, note, agent_stats (act_calls, tool_calls, messages, parse_errors, rehearsal_rounds,
  rehearsals, rejected), user_stats, n_messages, isolation (opening_request: real calls and DB-hash
  change during rehearsal; tau2_orchestrator: None, the agent holds no environment handle), error;
  opening_request records also hold trace (`rehearsal.trace.episode`: each round's rehearsals and memory,
  and the committed steps; observations, messages and memory cut to `rehearsal.trace.TRACE_MAX_CHARS`).
* `summarize`: per domain, pass^k = tau2's ``pass_hat_k`` (C(c,k)/C(n,k), tau-bench arXiv:2406.12045)
  averaged over tasks as tau2's ``compute_metrics`` does, over scored records only.
* Resume: with ``cache_path``, each finished (domain, task, trial) record is appended to a JSONL file and
  a rerun skips those already there (the cache is not keyed by model/config/protocol: one file per run
  setting, as `evaluation.harness` keys its cache folder by `options.fingerprint`). A record of a trial
  that raised (``error`` set) is never cached, and one in an older cache is not reused: a rerun plays it.
* A user-simulator endpoint that fails (`roles.user.EndpointError`) is not the task's failure: it stops
  the run (re-raised, naming the task and trial) and nothing is recorded or cached for that trial.
"""

from __future__ import annotations

import json
import threading
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core import EnvaceError
from envace_core.envs.tau2.tasks import NL_SKIPPED, task_context, tau2_task
from envace_core.evaluation.protocols import MAX_STEPS, TAU2_ORCHESTRATOR, check_protocol
from envace_core.evaluation.tau2_agents import EnvaceTau2Agent, SimulatedUser
from envace_core.rehearsal.agent import RehearsalAgent
from envace_core.roles.user import EndpointError
from envace_core.store.files import read_jsonl
from envace_core.types import Role, Task, Trajectory

if TYPE_CHECKING:
    from envace_core.config import RunConfig
    from envace_core.engines.merging import MergingEngine
    from envace_core.envs.base import ToolEnvironment

AgentFor = Callable[[str, int], RehearsalAgent]


def policy_agent(cfg: RunConfig, engine, mode: str = "none", n: int = 0, *, domain: str,
                 seed: int) -> RehearsalAgent:
    """The evaluated policy as a `RehearsalAgent`: committed ACT at ``eval.temperature`` for at most
    ``eval.max_turns`` turns (``rollout.max_new_tokens_act``, ``rollout.top_p``); rehearsals in `mode`
    ("none" | "parallel" | "sequential") with `n` per round (`training.policy.rehearsal_params`: at
    ``rehearsal.temperature``, format-constrained only with ``rehearsal.constrained_decoding``), the config's
    memory budget and content, re-entry and (``rehearsal.verifier``) `domain`'s verifier checks (with
    ``rehearsal.grounded_errors``, `verifier.grounded_error_check` too; ``rehearsal.prune_rejected``)."""
    from envace_core.rehearsal.verifier import default_checks
    from envace_core.training.policy import rehearsal_params, rollout_params

    act = rollout_params(cfg, temperature=cfg.eval.temperature, max_turns=cfg.eval.max_turns,
                         lenient=cfg.eval.lenient_tool_format)
    reh = rehearsal_params(cfg, cfg.eval.max_turns)
    checks = (default_checks(domain, cfg.rehearsal.grounded_errors)
              if cfg.rehearsal.verifier and mode != "none" else None)
    return RehearsalAgent(engine, mode, n, cfg.rehearsal.memory_max_tokens, act, reh, seed=seed,
                          verifier=checks, reenter=cfg.rehearsal.reenter,
                          memory_content=cfg.rehearsal.memory_content, prune_rejected=cfg.rehearsal.prune_rejected)


# ---------------------------------------------------------------------------- tau2_orchestrator
def build_orchestrator(task: Task, agent: RehearsalAgent, user: SimulatedUser | None = None, *,
                       environment=None, max_steps: int = MAX_STEPS, max_errors: int = 10,
                       seed: int | None = 0, policy_max_chars: int | None = None):
    """(tau2 ``Orchestrator``, `EnvaceTau2Agent`, `EnvaceUserSimulator`) for one of our tau2 `task`s, as
    tau2's ``run_task`` builds it. `environment`: a tau2 ``Environment`` (default: a fresh one from
    tau2's registry). Raises `EnvaceError` for a task without a tau2 record."""
    from tau2.orchestrator.orchestrator import Orchestrator
    from tau2.registry import registry

    t2 = tau2_task(task)
    env = environment if environment is not None else registry.get_env_constructor(task.domain)()
    player = EnvaceTau2Agent(tools=env.get_tools(), domain_policy=env.get_policy(), agent=agent,
                             domain=task.domain, task_id=task.id, seed=seed, policy_max_chars=policy_max_chars)
    try:
        user_tools = env.get_user_tools()
    except ValueError:  # tau2: "User tools not available"
        user_tools = None
    sim_user = (user or SimulatedUser()).simulator(user_tools or None, str(t2.user_scenario), agent.engine, seed)
    orch = Orchestrator(domain=task.domain, agent=player, user=sim_user, environment=env, task=t2,
                        max_steps=max_steps, max_errors=max_errors, seed=seed)
    return orch, player, sim_user


def score_simulation(domain: str, task, simulation) -> dict:
    """tau2's ``evaluate_simulation(EvaluationType.ALL)`` of a tau2 ``task``'s simulation, NL_ASSERTION
    dropped from the basis (`protocols`). Returns reward (None if judged only by NL assertions),
    reward_breakdown, db_match, nl_assertions, note; a stop (agent_stop, user_stop) whose messages end
    in a tool call without its result (`unanswered_tool_calls`, which tau2's evaluator cannot replay)
    scores 0 with termination_reason `rewards.DANGLING_TOOL_CALL`."""
    from tau2.data_model.simulation import TerminationReason
    from tau2.data_model.tasks import RewardType
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    from envace_core.envs.tau2.environment import unanswered_tool_calls
    from envace_core.training.rewards import DANGLING_TOOL_CALL

    out: dict[str, Any] = {"nl_assertions": None}
    stopped = simulation.termination_reason in (TerminationReason.AGENT_STOP, TerminationReason.USER_STOP)
    if stopped and (dangling := unanswered_tool_calls(simulation.messages)):
        return {**out, "reward": 0.0, "reward_breakdown": {}, "db_match": None,
                "termination_reason": DANGLING_TOOL_CALL,
                "note": f"the run stopped before the result of tool call(s) {dangling} came back"}
    ec = task.evaluation_criteria
    if ec is not None and RewardType.NL_ASSERTION in ec.reward_basis:
        basis = [b for b in ec.reward_basis if b != RewardType.NL_ASSERTION]
        out["nl_assertions"] = NL_SKIPPED
        if not basis:
            return {**out, "reward": None, "reward_breakdown": {}, "db_match": None,
                    "note": f"judged only by NL assertions: {NL_SKIPPED}"}
        task = task.model_copy(deep=True)
        task.evaluation_criteria.reward_basis = basis
    ri = evaluate_simulation(simulation=simulation, task=task, evaluation_type=EvaluationType.ALL,
                             solo_mode=False, domain=domain)
    return {**out, "reward": float(ri.reward),
            "reward_breakdown": {(k.value if hasattr(k, "value") else str(k)): float(v)
                                 for k, v in (ri.reward_breakdown or {}).items()},
            "db_match": ri.db_check.db_match if ri.db_check is not None else None,
            "note": (ri.info or {}).get("note")}


def orchestrated_trial(task: Task, agent: RehearsalAgent, seed: int, *, user: SimulatedUser | None = None,
                       max_steps: int = MAX_STEPS, max_errors: int = 10,
                       policy_max_chars: int | None = None) -> dict:
    """One ``tau2_orchestrator`` dialogue of `task`, scored: the record fields of the module docstring."""
    orch, player, sim_user = build_orchestrator(task, agent, user, max_steps=max_steps, max_errors=max_errors,
                                                seed=seed, policy_max_chars=policy_max_chars)
    sim = orch.run()
    return {"termination_reason": str(getattr(sim.termination_reason, "value", sim.termination_reason)),
            **score_simulation(task.domain, tau2_task(task), sim),
            "agent_stats": dict(player.stats), "user_stats": dict(sim_user.stats), "n_messages": len(sim.messages),
            "isolation": None}


# ------------------------------------------------------------------------------ opening_request
def opening_request_trial(task: Task, agent: RehearsalAgent, *, policy_max_chars: int | None = None,
                          environment: Callable[[Task], ToolEnvironment] | None = None,
                          score: Callable[[Task, Trajectory], Trajectory] | None = None) -> dict:
    """One ``opening_request`` run of `task`, scored: the record fields of the module docstring.

    `environment(task)`: the real environment (default `Tau2Environment` of the task's domain), reset here;
    `score(task, trajectory)`: the scorer (default: the replay reward with tau2's termination rule,
    `rewards.score_trajectory`). Tool learning passes both for tools that only an implementation runs.
    """
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.training.rewards import score_trajectory
    from envace_core.training.rollout import real_rollout

    env = environment(task) if environment is not None else Tau2Environment(task.domain)
    env.reset(task)
    ctx = task_context(task, policy_max_chars)
    if agent.mode == "none":  # nothing rehearses, so there is nothing to isolate
        traj, rounds, iso = real_rollout(agent.engine, ctx, env, agent.act, seed=agent.seed), [], None
    else:
        res = agent.run(ctx, env)
        traj, rounds, iso = res.committed, res.rounds, res.isolation
    traj = (score or score_trajectory)(task, traj)
    info = traj.reward_info or {}
    tools = sum(1 for s in traj.steps if s.action is not None)
    texts = sum(1 for s in traj.steps if s.action is None and s.message)
    return {"reward": traj.reward, "reward_breakdown": dict(traj.sub_rewards or {}),
            "db_match": info.get("db_match"), "termination_reason": traj.termination,
            "nl_assertions": info.get("nl_assertions"), "note": info.get("note") or info.get("error"),
            "agent_stats": {"act_calls": sum(1 for g in traj.generations if g.role == Role.ACT),
                            "tool_calls": tools, "messages": texts,
                            "parse_errors": int(traj.termination == "parse_error"),
                            "rehearsal_rounds": len(rounds),
                            "rehearsals": sum(len(r.rehearsals) for r in rounds),
                            "rejected": sum(len(r.rejected) for r in rounds)},
            "user_stats": {}, "n_messages": 1 + 2 * tools + texts, "isolation": iso,
            "trace": _trace(rounds, traj)}


def _trace(rounds, traj) -> dict:
    """`rehearsal.trace.episode`, or {"error": ...} if it fails: a record is scored already, and a trace
    that cannot be written must not turn it into a failed episode."""
    from envace_core.rehearsal import trace

    try:
        return trace.episode(rounds, traj)
    except Exception as e:  # noqa: BLE001 (any failure of a best-effort record field)
        return {"error": f"{type(e).__name__}: {e}"[:300]}


# ----------------------------------------------------------------------------------------- run
def run_tau2(tasks: Sequence[Task], agent_for: AgentFor, protocol: str, *, trials: int = 1, seed: int = 0,
             user: SimulatedUser | None = None, max_steps: int = MAX_STEPS, max_errors: int = 10,
             policy_max_chars: int | None = None, cache_path: str | Path | None = None,
             raise_errors: bool = False, environment: Callable[[Task], ToolEnvironment] | None = None,
             score: Callable[[Task, Trajectory], Trajectory] | None = None,
             merging: MergingEngine | None = None, concurrency: int = 1, progress: str | None = None) -> dict:
    """Each of `tasks` (our tau2 `Task`s, e.g. `envs.tau2.tasks.load_tasks`) `trials` times under `protocol`.

    Trial t of a task is played by ``agent_for(task.domain, seed + t)`` (`policy_agent`); `user`, `max_steps`
    and `max_errors` apply to ``tau2_orchestrator``, `environment`/`score` to ``opening_request``
    (`opening_request_trial`). A (task, trial) that raises is recorded with ``error``, reward 0 and
    termination "error" (or re-raised with `raise_errors`), and not written to `cache_path`.
    With `merging` (the `engines.merging.MergingEngine` that `agent_for`'s agents and the user simulator
    generate through) and `concurrency` > 1, up to `concurrency` trials run at once, their engine calls
    merged into one batch per turn (`MergingEngine.map`): every call keeps its own seeds, so a trial's
    record is the one it gets alone up to float rounding of the larger batches; records are returned in
    (task, trial) order and cached as each trial ends. `progress`: a progress bar's label (None: no bar).

    Returns ``{"protocol", "domains": summarize(...), "results": [records], "skipped": n_from_cache}``.
    Raises `EnvaceError` for an unknown protocol, trials < 1, concurrency < 1, or `environment`/`score` with
    ``tau2_orchestrator`` (tau2's Orchestrator runs tau2's own environment and evaluator);
    `roles.user.EndpointError` when the user simulator's endpoint fails (the trials finished before it
    stay in the cache; the failing one is neither recorded nor cached, and no further trial starts).
    """
    check_protocol(protocol)
    if trials < 1:
        raise EnvaceError(f"trials must be >= 1, got {trials}")
    if concurrency < 1:
        raise EnvaceError(f"concurrency must be >= 1, got {concurrency}")
    if protocol == TAU2_ORCHESTRATOR and (environment is not None or score is not None):
        raise EnvaceError("tau2_orchestrator runs tau2's own environment and evaluator: environment= and "
                          "score= apply to opening_request only")
    path = Path(cache_path) if cache_path is not None else None
    cache = _load_cache(path)
    keys = [(task, trial) for task in tasks for trial in range(trials)]
    done = {i: cache[(t.domain, t.id, k)] for i, (t, k) in enumerate(keys) if (t.domain, t.id, k) in cache}
    todo = [i for i in range(len(keys)) if i not in done]
    bar = tqdm(total=len(keys), initial=len(done), desc=progress, unit="task", disable=progress is None)
    lock = threading.Lock()

    def play(_engine, i: int) -> dict:
        task, trial = keys[i]
        rec: dict[str, Any] = {"protocol": protocol, "domain": task.domain, "task_id": task.id,
                               "trial": trial, "seed": seed + trial, "error": None}
        try:
            agent = agent_for(task.domain, seed + trial)
            rec.update(orchestrated_trial(task, agent, seed + trial, user=user, max_steps=max_steps,
                                          max_errors=max_errors, policy_max_chars=policy_max_chars)
                       if protocol == TAU2_ORCHESTRATOR else
                       opening_request_trial(task, agent, policy_max_chars=policy_max_chars,
                                             environment=environment, score=score))
        except EndpointError as e:  # the user simulator's server, not the task: stop, record nothing
            raise EndpointError(f"{e} [during {task.id} trial {trial}; not recorded: a rerun plays it]") from None
        except Exception as e:
            if raise_errors:
                raise
            rec.update(reward=0.0, reward_breakdown={}, termination_reason="error",
                       error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
        rec["success"] = None if rec.get("reward") is None else float(_successful(rec["reward"]))
        return rec

    def finished(_k: int, rec: dict) -> None:  # in the trial's own thread when concurrent
        with lock:
            bar.update(1)
            if path is not None and rec["error"] is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.write(json.dumps(rec, sort_keys=True, default=str) + "\n")

    try:
        if merging is not None and concurrency > 1:
            played = merging.map(play, todo, workers=concurrency, on_result=finished)
        else:
            played = []
            for i in todo:
                played.append(play(None, i))
                finished(i, played[-1])
    finally:
        bar.close()
    recs = {**done, **dict(zip(todo, played))}
    results = [recs[i] for i in range(len(keys))]
    return {"protocol": protocol, "domains": summarize(results, trials), "results": results, "skipped": len(done)}


def evaluate_policy(cfg: RunConfig, engine, tasks: Sequence[Task], protocol: str, *, mode: str = "none",
                    n: int = 0, trials: int = 1, seed: int = 0, user: SimulatedUser | None = None,
                    max_steps: int = MAX_STEPS, cache_path: str | Path | None = None, raise_errors: bool = False,
                    environment: Callable[[Task], ToolEnvironment] | None = None,
                    score: Callable[[Task, Trajectory], Trajectory] | None = None,
                    concurrency: int | None = None, progress: str | None = None) -> dict:
    """`run_tau2` of the policy behind `engine` as `cfg` sets it up (`policy_agent` with rehearsal `mode`/`n`;
    prompts' policy text cut at ``data.policy_max_chars``). The evaluate stage, `envace eval` and tool
    learning's measurement all call this, so the same model, tasks, protocol and seed give the same records.

    concurrency: trials run at once through one `engines.merging.MergingEngine` over `engine` (None:
    ``eval.concurrency``). It is 1 when `user` generates with an engine of its own (that engine would
    serve several threads at once) or with an endpoint (a worker waiting on it would hold up every
    merged turn); a `user` on `engine` itself generates through the merged engine too."""
    from envace_core.engines.merging import MergingEngine

    conc = cfg.eval.concurrency if concurrency is None else concurrency
    if user is not None and (user.client is not None or user.engine not in (None, engine)):
        conc = 1
    merging = MergingEngine(engine) if conc > 1 and len(tasks) * trials > 1 else None
    eng = merging or engine
    if user is not None and user.engine is engine and merging is not None:
        user = replace(user, engine=merging)
    return run_tau2(tasks, lambda domain, s: policy_agent(cfg, eng, mode, n, domain=domain, seed=s), protocol,
                    trials=trials, seed=seed, user=user, max_steps=max_steps,
                    policy_max_chars=cfg.data.policy_max_chars, cache_path=cache_path, raise_errors=raise_errors,
                    environment=environment, score=score, merging=merging, concurrency=conc, progress=progress)


def _successful(reward: float) -> bool:
    from tau2.metrics.agent_metrics import is_successful

    return is_successful(reward)


# ----------------------------------------------------------------------------------- summaries
def pass_hat_ks(successes: dict[str, list[bool]], max_k: int) -> dict[int, float]:
    """Mean over tasks of tau2's ``pass_hat_k(n, c, k)`` for k = 1..max_k (tasks with < k trials skipped)."""
    from tau2.metrics.agent_metrics import pass_hat_k

    out = {}
    for k in range(1, max_k + 1):
        vals = [pass_hat_k(len(s), sum(s), k) for s in successes.values() if len(s) >= k]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def summarize_results(rs: Sequence[dict], trials: int) -> dict:
    """One group of records (a domain, or a whole condition): n_tasks, n_results, n_scored, pass_hat_k
    ({k: mean pass^k}, scored records only), avg_reward, reward_breakdown (mean per criterion over the
    scored records that have it), termination_reasons, nl_assertions_skipped, errors, parse_errors."""
    scored = [r for r in rs if r.get("reward") is not None]
    succ: dict[str, list[bool]] = defaultdict(list)
    for r in scored:
        succ[r["task_id"]].append(_successful(r["reward"]))
    keys = sorted({k for r in scored for k in r.get("reward_breakdown", {})})
    return {
        "n_tasks": len({r["task_id"] for r in rs}), "n_results": len(rs), "n_scored": len(scored),
        "pass_hat_k": pass_hat_ks(succ, trials),
        "avg_reward": sum(r["reward"] for r in scored) / len(scored) if scored else None,
        "reward_breakdown": {k: sum(r["reward_breakdown"][k] for r in scored if k in r["reward_breakdown"])
                             / sum(1 for r in scored if k in r["reward_breakdown"]) for k in keys},
        "termination_reasons": dict(Counter(r["termination_reason"] for r in rs)),
        "nl_assertions_skipped": sum(1 for r in rs if r.get("nl_assertions")),
        "errors": sum(1 for r in rs if r.get("error")),
        "parse_errors": sum((r.get("agent_stats") or {}).get("parse_errors", 0) for r in rs),
    }


def summarize(results: Sequence[dict], trials: int) -> dict:
    """{domain: `summarize_results` of its records}, domains in first-seen order."""
    by_domain: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_domain[r["domain"]].append(r)
    return {dom: summarize_results(rs, trials) for dom, rs in by_domain.items()}


# --------------------------------------------------------------------------------------- cache
_CACHE_FIELDS = {"domain": str, "task_id": str, "trial": int, "termination_reason": str}


def _cache_record(r: Any) -> dict:
    """`r` if a cache line holds a record `summarize` can use (the fields it reads, with their types),
    else TypeError (`store.files.read_jsonl` then skips it)."""
    num = (int, float)
    if not (isinstance(r, dict) and all(isinstance(r.get(k), t) for k, t in _CACHE_FIELDS.items())
            and (r.get("reward") is None or isinstance(r["reward"], num))
            and isinstance(r.get("reward_breakdown"), dict)
            and all(isinstance(v, num) for v in r["reward_breakdown"].values())
            and isinstance(r.get("agent_stats", {}), dict)):
        raise TypeError("not a tau2 cache record")
    return r


def _load_cache(path: Path | None) -> dict[tuple, dict]:
    """{(domain, task_id, trial): record} from a `run_tau2` cache. A line that is not JSON (cut by a kill
    mid-write) or not a record (`_cache_record`) is skipped, so that (task, trial) runs again; one
    warning per file names it (`store.files.read_jsonl`). A record of a trial that raised (``error`` set,
    written by older versions) is left out silently, so that (task, trial) runs again too."""
    if path is None:
        return {}
    return {(r["domain"], r["task_id"], r["trial"]): r for r in read_jsonl(path, _cache_record)
            if not r.get("error")}
