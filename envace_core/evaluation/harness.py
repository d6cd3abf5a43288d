"""The one evaluation harness (`envace eval`, the main job's evaluate stage, tool learning, the benchmarks): runs the chosen benches and writes the report."""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envace_core import EnvaceError
from envace_core.config import RunConfig, load_config
from envace_core.evaluation.code_ledger import begin as ledger_begin
from envace_core.evaluation.code_ledger import code_version, history, record, reuse_note
from envace_core.evaluation.options import (
    REHEARSAL_APPLIES_TO,
    EvalOptions,
    check_bench_data,
    fingerprint,
    parse_benches,
    parse_rehearsal,
    uses,
)
from envace_core.evaluation.protocols import TAU2_ORCHESTRATOR, describe
from envace_core.evaluation.vita import LLMJudge
from envace_core.models import (
    ModelRefError,
    ResolvedModel,
    check_model_ref,
    resolve_model,
    resolve_model_ref,
)
from envace_core.store.files import atomic_write_text, read_jsonl
from envace_core.training.policy import load_engine


# ----------------------------------------------------------------------------------------- helpers
def _progress(iterable, desc: str, total: int):
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit="task")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[-80:]


def _path_key(path: str) -> str:
    return f"{_safe(Path(path).name)}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def _need(rec: Any, **types: Any) -> dict:
    """`rec` if it is a dict whose keys `types` hold values of those types, else TypeError/KeyError."""
    if not isinstance(rec, dict):
        raise TypeError(f"cache record is a {type(rec).__name__}, not an object")
    for k, t in types.items():
        if not isinstance(rec[k], t):
            raise TypeError(f"cache record field {k!r} is a {type(rec[k]).__name__}")
    return rec


def _vita_record(rec: Any) -> dict:
    return _need(rec, task_id=str, trial=int, reward=(int, float), termination=str)


def _finmcp_record(rec: Any) -> dict:
    _need(rec, sample=dict, decode=dict)
    _need(rec["sample"], id=str, tp=int, fp=int, fn=int)
    return rec


def _append_jsonl(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec, sort_keys=True, default=str) + "\n")


def _tau2_split(domain: str, split: str) -> str:
    """tau2's split for --split `split` (test | full): full is every task ("full" for telecom, else "base";
    mock has only "base", and no test split: `EvalOptions.check` refuses --split test with tau2:mock)."""
    if split == "full":
        return "full" if domain == "telecom" else "base"
    return "test"


# ----------------------------------------------------------------------------------------- runners
@dataclass
class _Ctx:
    """What every bench runner needs: settings, engines, cache folder and the work counters."""

    opts: EvalOptions
    cfg: RunConfig
    mode: str
    n: int
    engine: Any
    user_engine: Any
    user_client: Any
    judge: Any
    cache: Path
    work: dict = field(default_factory=dict)

    def count(self, label: str, ran: int, cached: int) -> None:
        w = self.work.setdefault(label, {"ran": 0, "cached": 0})
        w["ran"] += ran
        w["cached"] += cached

    def rehearsal_agent(self, domain: str):
        """The policy with the `--rehearsal` mode/n (`tau2.policy_agent`; seed ``--seed``); None for mode
        "none" (the BFCL runner's "no rehearsal")."""
        return None if self.mode == "none" else self.agent(domain)

    def agent(self, domain: str):
        """The policy as a `RehearsalAgent` (`tau2.policy_agent`) with the `--rehearsal` mode/n, seed ``--seed``."""
        from envace_core.evaluation.tau2 import policy_agent

        return policy_agent(self.cfg, self.engine, self.mode, self.n, domain=domain, seed=self.opts.seed)


def run_tau2_bench(ctx: _Ctx, domain: str) -> dict:
    """tau2 `domain` through `tau2.evaluate_policy` under ``--protocol``, ``eval.concurrency`` tasks at a time
    (progress bar; cached per (task, trial) as each ends)."""
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.evaluation.tau2 import evaluate_policy, summarize
    from envace_core.evaluation.tau2_agents import SimulatedUser

    split = _tau2_split(domain, ctx.opts.split)
    tasks = load_tasks(domain, split, ctx.opts.limit)
    cache = ctx.cache / f"tau2_{domain}.jsonl"
    user = SimulatedUser(engine=ctx.user_engine, client=ctx.user_client,
                         max_new_tokens=ctx.opts.user_max_new_tokens)
    r = evaluate_policy(ctx.cfg, ctx.engine, tasks, ctx.opts.protocol, mode=ctx.mode, n=ctx.n,
                        trials=ctx.opts.trials, seed=ctx.opts.seed, user=user, max_steps=ctx.opts.max_steps,
                        cache_path=cache, progress=f"tau2:{domain}")
    ctx.count(f"tau2:{domain}", len(r["results"]) - r["skipped"], r["skipped"])
    results: list[dict] = r["results"]
    summary = summarize(results, ctx.opts.trials).get(domain, {})
    return {"bench": "tau2", "name": domain, "split": split, "protocol": ctx.opts.protocol, "summary": summary,
            "results": results}


def _bfcl_report(categories: dict, limit: int | None):
    """A `BfclReport` over already-scored categories, with bfcl's groups and overall (`overall_scores`;
    the same composition `evaluate_bfcl` ends with)."""
    from envace_core.evaluation.bfcl_results import (
        BfclReport,
        overall_leaves,
        overall_scores,
    )

    rep = BfclReport(categories=categories, limit_per_category=limit)
    scores = {c: {"accuracy": r.accuracy, "total_count": r.n} for c, r in categories.items() if r.n}
    overall, rep.groups = overall_scores(scores)
    rep.overall = float(overall["accuracy"]) if overall else 0.0
    ev, rep.groups_evaluated = overall_scores(scores, only_evaluated=True)
    rep.overall_evaluated = None if ev is None else float(ev["accuracy"])
    rep.missing_categories = [c for c in overall_leaves() if c not in scores]
    rep.complete = not rep.missing_categories and limit is None
    return rep


def _bfcl_multi_turn(ctx: _Ctx, cat: str):
    """A multi-turn category's first `limit` entries through `run_multi_turn`, with Private Rehearsal when
    ``--rehearsal`` asks for it; each scored entry is appended to ``bfcl_<cat>.jsonl`` at once, so a rerun
    plays only the entries not there yet."""
    from envace_core.evaluation.bfcl import load_bfcl
    from envace_core.evaluation.bfcl_results import CategoryResult, EntryResult, tally
    from envace_core.evaluation.bfcl_run import run_multi_turn, sampling_params

    entries = load_bfcl(cat, ctx.opts.limit)
    path = ctx.cache / f"bfcl_{cat}.jsonl"
    have = {r.id: r for r in read_jsonl(path, EntryResult.model_validate)}
    todo = [e for e in entries if e.id not in have]
    if todo:
        print(f"[eval] bfcl:{cat} ({len(todo)} entries; rehearsal {ctx.opts.rehearsal}) ...", flush=True)

        def keep(r: EntryResult) -> None:
            _append_jsonl(path, r.model_dump(mode="json"))
            have[r.id] = r

        c = ctx.cfg
        run_multi_turn(ctx.engine, todo, sampling_params(ctx.engine, c.rollout.max_new_tokens_act,
                                                         c.eval.temperature, ctx.opts.seed),
                       batch_size=4, rehearsal=ctx.rehearsal_agent("bfcl"), on_entry=keep)
    ctx.count(f"bfcl:{cat}", len(todo), len(entries) - len(todo))
    return tally(CategoryResult(category=cat, entries=[have[e.id] for e in entries]))


def run_bfcl_benches(ctx: _Ctx, categories: list[str]) -> dict:
    """BFCL categories through `evaluate_bfcl` (cached per (category, limit)) or, multi-turn ones,
    `_bfcl_multi_turn` (cached per entry); one report with bfcl's overall."""
    from envace_core.evaluation.bfcl import MULTI_TURN_CATEGORIES
    from envace_core.evaluation.bfcl_results import CategoryResult
    from envace_core.evaluation.bfcl_run import evaluate_bfcl

    done: dict[str, Any] = {}
    for cat in categories:
        if cat in MULTI_TURN_CATEGORIES:
            done[cat] = _bfcl_multi_turn(ctx, cat)
            print(f"[eval] bfcl:{cat}: accuracy {done[cat].accuracy:.3f} over {done[cat].n} "
                  f"({done[cat].decode_errors} with decode errors)", flush=True)
            continue
        path = ctx.cache / f"bfcl_{cat}_limit-{ctx.opts.limit or 'all'}.json"
        if path.is_file():
            try:
                done[cat] = CategoryResult.model_validate_json(path.read_text())
                ctx.count(f"bfcl:{cat}", 0, done[cat].n)
                continue
            except ValueError:  # not JSON or not a CategoryResult (pydantic's ValidationError): recompute
                warnings.warn(f"eval cache {path}: malformed; recomputing bfcl:{cat}", RuntimeWarning)
        print(f"[eval] bfcl:{cat} ...", flush=True)
        rep = evaluate_bfcl(ctx.engine, [cat], ctx.opts.limit, max_new_tokens=ctx.cfg.rollout.max_new_tokens_act,
                            temperature=ctx.cfg.eval.temperature, seed=ctx.opts.seed, batch_size=4)
        done[cat] = rep.categories[cat]
        ctx.count(f"bfcl:{cat}", done[cat].n, 0)
        atomic_write_text(path, done[cat].model_dump_json())
        print(f"[eval] bfcl:{cat}: accuracy {done[cat].accuracy:.3f} over {done[cat].n} "
              f"({done[cat].decode_errors} decode errors)", flush=True)
    return {"bench": "bfcl", "name": "bfcl", "report": _bfcl_report(done, ctx.opts.limit).model_dump()}


def _vita_messages(task, traj) -> list[dict]:
    msgs = [{"role": "user", "content": task.first_user_message}]
    for s in traj.steps:
        if s.action is not None:
            msgs.append({"role": "assistant", "content": json.dumps({"name": s.action.name,
                                                                     "arguments": s.action.arguments})})
            obs = s.real_observation or s.observation
            msgs.append({"role": "tool", "content": obs.content if obs else ""})
        elif s.message:
            msgs.append({"role": "assistant", "content": s.message})
    return msgs


def run_vita_bench(ctx: _Ctx, path: str) -> dict:
    """VitaBench tasks at `path` (module docstring), cached per (task, trial); `vita_metrics` over them."""
    from envace_core.envs.vita import VitaEnvironment, load_vitabench, vita_context
    from envace_core.evaluation.vita import judge_reward, vita_metrics

    tasks = load_vitabench(path)[: ctx.opts.limit]
    cache = ctx.cache / f"vita_{_path_key(path)}.jsonl"
    have = {(r["task_id"], r["trial"]): r for r in read_jsonl(cache, _vita_record)}
    results = []
    for task in _progress(tasks, "vita", len(tasks)):
        for trial in range(ctx.opts.trials):
            if (task.id, trial) in have:
                results.append(have[(task.id, trial)])
                ctx.count("vita", 0, 1)
                continue
            agent = ctx.agent(task.domain)
            agent.seed = ctx.opts.seed + trial
            env = VitaEnvironment()
            env.reset(task)
            res = agent.run(vita_context(task), env)
            traj = res.committed
            judged = judge_reward(task, _vita_messages(task, traj), ctx.judge,
                                  terminated_early=traj.termination != "agent_message")
            rec = {"task_id": task.id, "domain": task.domain, "trial": trial, "reward": judged["reward"],
                   "rubric_score": judged["rubric_score"], "termination": traj.termination,
                   "tool_calls": sum(1 for s in traj.steps if s.action is not None),
                   "rehearsals": len(res.rehearsals)}
            _append_jsonl(cache, rec)
            results.append(rec)
            ctx.count("vita", 1, 0)
    by_task: dict[str, list[float]] = {}
    for r in results:
        by_task.setdefault(r["task_id"], []).append(float(r["reward"]))
    return {"bench": "vita", "name": path, "metrics": vita_metrics(by_task), "results": results,
            "terminations": dict(Counter(r["termination"] for r in results)),
            "judge_stats": dict(getattr(ctx.judge, "stats", {}))}


def run_finmcp_bench(ctx: _Ctx, path: str) -> dict:
    """FinMCP-Bench samples at `path` through `evaluate_finmcp`, one sample at a time (cached per sample);
    micro/macro TF1 and tool precision recomputed over all samples with `finmcp_metrics`."""
    from envace_core.evaluation.finmcp import PUBLISHED, finmcp_metrics, load_finmcp
    from envace_core.evaluation.finmcp_run import evaluate_finmcp, group_metrics

    samples = load_finmcp(path)[: ctx.opts.limit]
    cache = ctx.cache / f"finmcp_{_path_key(path)}.jsonl"
    have = {r["sample"]["id"]: r for r in read_jsonl(cache, _finmcp_record)}
    rows = []
    for s in _progress(samples, "finmcp", len(samples)):
        if s.id in have:
            rows.append(have[s.id])
            ctx.count("finmcp", 0, 1)
            continue
        r = evaluate_finmcp(ctx.engine, [s], max_new_tokens=ctx.cfg.rollout.max_new_tokens_act,
                                   temperature=ctx.cfg.eval.temperature, seed=ctx.opts.seed)
        row = {"sample": r["samples"][0], "decode": r["decode"]}
        _append_jsonl(cache, row)
        rows.append(row)
        ctx.count("finmcp", 1, 0)
    per = [r["sample"] for r in rows]
    overall = finmcp_metrics([(p["tp"], p["fp"], p["fn"]) for p in per])
    decode: Counter = Counter()
    for r in rows:
        decode.update({k: v for k, v in r["decode"].items() if isinstance(v, int)})
    return {"bench": "finmcp", "name": path, "n_samples": len(per), "micro": overall["micro"],
            "macro": overall["macro"], "by_task": group_metrics(per, "task"), "decode": dict(decode),
            "published": dict(PUBLISHED)}


# -------------------------------------------------------------------------------------------- run
def _as_flag(flag: str, ref: str, e: ModelRefError) -> ModelRefError:
    """`e` (raised for a model ref, naming ``--model``) re-raised as naming `flag` instead."""
    msg = str(e)
    msg = flag + msg[len("--model"):] if msg.startswith("--model ") else f"{flag} {ref!r}: {msg}"
    return type(e)(msg)


def _side_model(flag: str, ref: str, opts: EvalOptions, cfg: RunConfig) -> ResolvedModel:
    """`ref` given to `flag` (--user-model, --judge-model) resolved as `--model` is (`resolve_model_ref`), and,
    when it is its own base (not an s3:// one), its folder checked (`models.resolve_model`): everything short
    of loading weights, so a bad ref fails before the policy loads. Raises `ModelRefError` / `AdapterError` /
    `ModelNotFoundError` naming `flag`."""
    try:
        model = resolve_model_ref(ref, opts.registry or cfg.store.registry, base_ref=cfg.model.ref)
    except ModelRefError as e:
        raise _as_flag(flag, ref, e) from None
    if model.base_ref == ref and not ref.startswith("s3://"):
        resolve_model(ref, setting=flag)
    return model


def _load_side(flag: str, cfg: RunConfig, model: ResolvedModel):
    try:
        return load_engine(cfg, model)
    except ModelRefError as e:
        raise _as_flag(flag, model.ref, e) from None


def _endpoints(opts: EvalOptions, specs: list) -> dict[str, Any]:
    """{flag: OpenAIChatClient} for the --user-url / --judge-url this run will call, each probed first
    (`OpenAIChatClient.probe`, a GET {url}/models of a few seconds): the user simulator plays tau2 under
    tau2_orchestrator and, without a judge of its own, judges VitaBench; the judge judges VitaBench.
    A URL the run will not call is not probed (`run_eval` refuses one first: `options.check_used`).
    Raises `roles.user.EndpointError` naming the flag, the URL and the underlying error."""
    from envace_core.roles.user import OpenAIChatClient

    use = uses(opts, specs)
    used = {"--user-url": opts.user_url if use["user"] else None,
            "--judge-url": opts.judge_url if use["judge"] else None}
    clients = {flag: OpenAIChatClient(url, opts.user_url_model, name=flag) for flag, url in used.items() if url}
    for c in clients.values():
        c.probe()
    return clients


def _user(opts: EvalOptions, cfg: RunConfig, engine, user_model: ResolvedModel | None, client):
    """(user engine, user client, description) from --user-model / --user-url (default: the policy)."""
    from envace_core.roles.user import OpenAIChatClient

    if opts.user_url:
        return None, client or OpenAIChatClient(opts.user_url, opts.user_url_model, name="--user-url"), \
            f"OpenAI-compatible endpoint {opts.user_url} (model {opts.user_url_model})"
    if user_model is not None:
        user_engine, n = _load_side("--user-model", cfg, user_model)
        return user_engine, None, f"{opts.user_model} ({n / 1e6:.0f}M parameters) through our engine"
    return engine, None, "the evaluated policy itself (its own engine)"


def _judge(opts: EvalOptions, cfg: RunConfig, judge_model: ResolvedModel | None, client, user_engine, user_client,
           user_desc: str):
    from envace_core.roles.user import OpenAIChatClient

    if opts.judge_url:
        return LLMJudge(client=client or OpenAIChatClient(opts.judge_url, opts.user_url_model, name="--judge-url")), \
            f"endpoint {opts.judge_url}"
    if judge_model is not None:
        eng, _ = _load_side("--judge-model", cfg, judge_model)
        return LLMJudge(engine=eng), opts.judge_model
    return LLMJudge(engine=user_engine, client=user_client), f"the user simulator ({user_desc})"


def run_eval(opts: EvalOptions, *, engine=None, n_params: int | None = None,
             log: Callable[[str], None] = print) -> dict:
    """Evaluate `opts.model` on `opts.benches` and return the JSON-able results (what `report.write_report`
    renders). `engine`: an already-built policy engine (tests); default: loaded from `opts.model`.

    Raises, before any model loads: `BenchSpecError` (a bad --bench, or a vita: / finmcp: path whose data does
    not load: `check_bench_data`), `EnvaceError` (bad options: `EvalOptions.check`, an
    empty --model; `options.UnusedOptionError` for a user or judge flag no selected bench uses), `ModelRefError` /
    `AdapterError` / `ModelNotFoundError` for a bad --model, --user-model or --judge-model (naming that flag),
    and `roles.user.EndpointError` for a --user-url / --judge-url the run needs that does not answer
    (`_endpoints`). During the run, `EndpointError` when such an endpoint stops answering (nothing is
    recorded or cached for the task it was serving; finished tasks stay cached).
    """
    if not opts.model.strip():
        raise EnvaceError("--model is empty: give bundled:smollm2-135m-instruct, a local HF model folder, a LoRA "
                          "adapter folder, s3://... or registry:NAME@VERSION")
    specs = parse_benches(opts.benches)
    opts.check(specs, make_out=False)
    check_bench_data(specs)
    mode, n = parse_rehearsal(opts.rehearsal)
    cfg = load_config(opts.profile, opts.overrides)
    model = (check_model_ref(opts.model, cfg, registry=opts.registry) if engine is None  # base folder, bundled name
             else resolve_model_ref(opts.model, opts.registry or cfg.store.registry, base_ref=cfg.model.ref))
    user_model = _side_model("--user-model", opts.user_model, opts, cfg) if opts.user_model else None
    needs_judge = any(s.bench == "vita" for s in specs)
    judge_model = _side_model("--judge-model", opts.judge_model, opts, cfg) \
        if opts.judge_model and needs_judge else None
    opts.make_out()  # after the cheap checks (the model references too): a refused run leaves no --out folder
    clients = _endpoints(opts, specs)
    fp = fingerprint(opts, cfg, model, specs)
    cache = Path(opts.out).expanduser() / "cache" / fp
    t0 = time.perf_counter()
    if engine is None:
        engine, n_params = load_engine(cfg, model)
    user_engine, user_client, user_desc = _user(opts, cfg, engine, user_model, clients.get("--user-url"))
    judge, judge_desc = _judge(opts, cfg, judge_model, clients.get("--judge-url"), user_engine, user_client,
                               user_desc) if needs_judge else (None, None)
    load_s = time.perf_counter() - t0
    log(f"[eval] model {model.label}; tau2 protocol {opts.protocol}; rehearsal {opts.rehearsal}; user {user_desc}; "
        f"cache {cache}")
    ctx = _Ctx(opts, cfg, mode, n, engine, user_engine, user_client, judge, cache)
    benches: list[dict] = []
    bench_seconds: dict[str, float] = {}
    bfcl_cats = [s.arg for s in specs if s.bench == "bfcl"]
    code = code_version()
    ledger_begin(cache)
    try:
        for s in specs:
            t1 = time.perf_counter()
            if s.bench == "tau2":
                benches.append(run_tau2_bench(ctx, s.arg))
            elif s.bench == "vita":
                benches.append(run_vita_bench(ctx, s.arg))
            elif s.bench == "finmcp":
                benches.append(run_finmcp_bench(ctx, s.arg))
            elif s.arg == bfcl_cats[0]:  # all BFCL categories in one report (bfcl's overall spans them)
                benches.append(run_bfcl_benches(ctx, bfcl_cats))
            bench_seconds[s.label] = time.perf_counter() - t1
        cache_note = reuse_note(cache, sum(w["cached"] for w in ctx.work.values()), code)
        if cache_note:
            log(f"[eval] note: {cache_note}")
    finally:  # the episodes a stopped run cached are still this code's
        try:
            record(cache, sum(w["ran"] for w in ctx.work.values()), code)
        except OSError as e:  # the results stand; only their code version goes unrecorded
            warnings.warn(f"eval cache {cache}: code version not recorded ({type(e).__name__}: {e})", RuntimeWarning)
    tau2_limits = {"max_steps": opts.max_steps, "user_model": user_desc} if opts.protocol == TAU2_ORCHESTRATOR \
        else {"max_turns": cfg.eval.max_turns}
    return {
        "model": {"ref": model.ref, "base": model.base_ref, "adapter": model.adapter_dir, "label": model.label,
                  "n_params": n_params, "registry_version": (model.manifest or {}).get("version")},
        "settings": {"benches": [s.label for s in specs],
                     "rehearsal": {"mode": mode, "n": n, "applies_to": REHEARSAL_APPLIES_TO},
                     "protocol": opts.protocol, "trials": opts.trials, "split": opts.split, "limit": opts.limit,
                     "max_steps": opts.max_steps,
                     "seed": opts.seed, "profile": opts.profile, "overrides": opts.overrides},
        "user_simulator": user_desc, "judge": judge_desc, "fingerprint": fp, "cache": str(cache),
        "code": {**code, "cache_history": history(cache), "cache_note": cache_note},
        "protocol": {"tau2": describe(opts.protocol, trials=opts.trials, seed=opts.seed, **tau2_limits),
                     "bfcl": "bfcl-eval AST / multi-turn checkers; Private Rehearsal (as --rehearsal) in "
                             "multi-turn categories only, single-turn categories never rehearse",
                     "vita": "opening request only, generated read-only tools (not the official ones), "
                             "rubric judge as configured",
                     "finmcp": "gold history up to each user turn; tool-name TF1 / precision; no rehearsal"},
        "benches": benches, "work": ctx.work,
        "seconds": {"load": load_s, **bench_seconds, "total": time.perf_counter() - t0},
    }
