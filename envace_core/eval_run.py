"""Benchmark evaluation of any model on any subset of benchmarks (`envace eval`, `workflows/evaluate.py`).

    run_eval(EvalOptions(model="registry:envace-policy@…", benches="tau2:airline,bfcl:simple",
                         rehearsal="parallel:4", out="/tmp/evalrun"))

Benchmarks (METHOD.md §6), each run by its existing adapter with the benchmark's own data and scorer:

* ``tau2:<domain>`` (airline, retail, telecom, mock): `evaluation.tau2.run_tau2` (tau2's Orchestrator and
  evaluator); our agent with or without Private Rehearsal, the user simulator on a local model or an
  OpenAI-compatible URL. `split` "test" (default) or "full" (tau2's ``base`` split: every task; telecom's
  ``full``); mock has only ``base``.
* ``bfcl:<category>``: `evaluation.bfcl.evaluate_bfcl` (bfcl-eval's data, AST / multi-turn checkers, BFCL's
  weighting). Multi-turn categories run entry by entry through `evaluation.bfcl.run_multi_turn`, with
  Private Rehearsal as for tau2 (a rehearsal round at the start of every user turn, every step with
  ``rehearsal.reenter``; memory in the committed prompt); single-turn categories never rehearse (one
  generation per entry, nothing to imagine).
* ``vita:<path>``: VitaBench task files at `path` (`evaluation.vita.load_vitabench`); the agent commits one
  execution against `VitaEnvironment` from the opening request (no simulated follow-up turns), with
  Private Rehearsal as for tau2, and the official sliding-window rubric loop (`vita.judge_reward`) is
  judged by `LLMJudge` on the judge model (default: the user simulator's model). The tools are NOT
  VitaBench's official ones (see `evaluation/vita.py`), so numbers are not comparable to published ones.
* ``finmcp:<path>``: `evaluation.finmcp.evaluate_finmcp` (TF1 and tool precision over tool names).

Models (`resolve_model_ref`): ``bundled:…``, a local HF folder, ``s3://…``, ``registry:NAME@VERSION``, or a
local LoRA adapter folder (``adapter_config.json``, or per-role ``act/`` + ``rehearse/``, and no
``config.json``), loaded over the profile's ``model.ref``.

Resume: finished work is cached under ``<out>/cache/<fingerprint>/`` (fingerprint = sha256 of the settings
that change results: model (a local adapter's file checksums too), rehearsal, user, judge, sampling; NOT
`limit`/`trials`/`split`, which only select work): tau2 and VitaBench per (task, trial) as JSONL lines, BFCL
multi-turn per entry, other BFCL categories per category (and limit), FinMCP per sample. Repeating the
command recomputes nothing finished; `results["work"]` counts what ran and what came from the cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from envace_core import EnvaceError
from envace_core.config import RunConfig, load_config
from envace_core.models import (  # noqa: F401  (re-exported: eval_run's public names before the move)
    ADAPTER_WEIGHTS,
    ROLES,
    AdapterError,
    ModelRefError,
    _check_partial_roles,
    adapter_load_error,
    check_adapter_dir,
    is_adapter_dir,
)
from envace_core.storage import atomic_write_text, read_jsonl

BENCHES = ("tau2", "bfcl", "vita", "finmcp")
TAU2_DOMAINS = ("airline", "retail", "telecom", "mock")
SPLITS = ("test", "full")
REHEARSAL_MODES = ("none", "parallel", "sequential")
REHEARSAL_APPLIES_TO = "tau2, VitaBench and BFCL multi-turn; single-turn BFCL and FinMCP never rehearse"


class BenchSpecError(EnvaceError):
    """A `--bench` spec names an unknown benchmark, domain or category, or a missing path."""


# ------------------------------------------------------------------------------------------ specs
@dataclass(frozen=True)
class BenchSpec:
    """One benchmark selection: `bench` (one of BENCHES) and `arg` (tau2 domain, bfcl category, or path)."""

    bench: str
    arg: str

    @property
    def label(self) -> str:
        return f"{self.bench}:{self.arg}"


def _bfcl_choices() -> list[str]:
    from envace_core.evaluation.bfcl import ALIASES, SUPPORTED_CATEGORIES

    return list(ALIASES) + list(SUPPORTED_CATEGORIES)


def parse_benches(text: str) -> list[BenchSpec]:
    """Parse ``"tau2:airline,bfcl:simple,vita:/data/vita,finmcp:/data/fin.json"`` (duplicates dropped).

    BFCL categories are bfcl's names (``simple`` = ``simple_python``). Raises `BenchSpecError` naming the
    offending item and the valid choices.
    """
    specs: list[BenchSpec] = []
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    if not items:
        raise BenchSpecError(f"--bench is empty; give e.g. tau2:airline,bfcl:simple (benchmarks: {', '.join(BENCHES)})")
    for item in items:
        bench, sep, arg = item.partition(":")
        bench, arg = bench.strip(), arg.strip()
        if bench not in BENCHES or not sep:
            raise BenchSpecError(f"--bench item {item!r}: unknown benchmark {bench!r}; write BENCH:ARG with BENCH "
                                 f"one of {', '.join(BENCHES)} (e.g. tau2:airline, bfcl:simple, vita:PATH, finmcp:PATH)")
        if bench == "tau2" and arg not in TAU2_DOMAINS:
            raise BenchSpecError(f"--bench item {item!r}: unknown tau2 domain {arg!r}; choose one of "
                                 f"{', '.join(TAU2_DOMAINS)}")
        if bench == "bfcl":
            from envace_core.evaluation.bfcl import ALIASES

            if arg not in _bfcl_choices():
                raise BenchSpecError(f"--bench item {item!r}: unknown or unsupported BFCL category {arg!r}; "
                                     f"choose one of {', '.join(_bfcl_choices())}")
            arg = ALIASES.get(arg, arg)
        if bench in ("vita", "finmcp"):
            if not arg or not Path(arg).expanduser().exists():
                raise BenchSpecError(f"--bench item {item!r}: {bench} needs the path of its data, e.g. "
                                     f"{bench}:/data/{bench}; {arg or '(empty)'} does not exist")
            arg = str(Path(arg).expanduser().resolve())
        spec = BenchSpec(bench, arg)
        if spec not in specs:
            specs.append(spec)
    return specs


def parse_rehearsal(text: str) -> tuple[str, int]:
    """``none`` | ``parallel:N`` | ``sequential:N`` (N >= 1) -> (mode, n); raises `EnvaceError`."""
    mode, _, n = (text or "none").strip().partition(":")
    if mode == "none" and not n:
        return "none", 0
    if mode not in REHEARSAL_MODES[1:] or not n.isdigit() or int(n) < 1:
        raise EnvaceError(f"--rehearsal {text!r}: write none, parallel:N or sequential:N with N >= 1 "
                          "(e.g. parallel:4)")
    return mode, int(n)


# ------------------------------------------------------------------------------------------ models
@dataclass
class ResolvedModel:
    """A `--model` reference resolved: the base model reference (for `models.resolve_model`), an optional
    LoRA adapter folder, and the registry manifest when it came from the registry."""

    ref: str
    base_ref: str
    adapter_dir: str | None = None
    manifest: dict | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        if self.manifest is not None:
            return f"{self.ref} (base {self.base_ref} + LoRA adapter)"
        if self.adapter_dir is not None:
            return f"{self.ref} (LoRA adapter over {self.base_ref})"
        return self.ref


def resolve_model_ref(ref: str, registry_root: str, base_ref: str = "bundled:smollm2-135m-instruct") -> ResolvedModel:
    """A local path, ``s3://…``, ``bundled:…`` or ``registry:NAME@VERSION`` as a `ResolvedModel`.

    A registry model is verified first (`lineage.Registry.verify`: every artifact's sha256, and the manifest
    signature when $ENVACE_REGISTRY_HMAC_KEY is set); its base model is the manifest's ``base_model.ref`` and
    its adapter ``artifacts/adapter``. Raises `ModelRefError` (unregistered, tampered, no adapter).
    A local LoRA adapter folder (`is_adapter_dir`) is checked (`check_adapter_dir`, raises `AdapterError`)
    and loaded over `base_ref` (`run_eval` passes the profile's ``model.ref``); a base whose shapes do not
    fit fails at load (`AdapterError`). Another local path must be a folder with ``config.json``, else
    `ModelRefError` (or `AdapterError` for half a per-role adapter); ``bundled:``/``s3://`` are checked
    when loaded (`models.resolve_model`).
    """
    if not ref.startswith("registry:"):
        local = Path(ref).expanduser()
        if "://" in ref or ref.startswith("bundled:"):
            return ResolvedModel(ref=ref, base_ref=ref)
        if is_adapter_dir(local):
            check_adapter_dir(local)  # a broken adapter fails here, before any model loads
            return ResolvedModel(ref=ref, base_ref=base_ref, adapter_dir=str(local.resolve()))
        if not (local / "config.json").is_file():
            _check_partial_roles(local)
            what = ("no such file or folder" if not local.exists() else "neither a model folder (config.json) "
                    "nor a LoRA adapter folder (adapter_config.json, or per-role act/ and rehearse/)")
            hint = f" (a registry version is written registry:{ref})" if "@" in ref and not local.exists() else ""
            raise ModelRefError(f"--model {ref!r}: {what}; give bundled:smollm2-135m-instruct, a local HF model "
                                f"folder, a LoRA adapter folder, s3://... or registry:NAME@VERSION{hint}")
        return ResolvedModel(ref=ref, base_ref=ref)
    from envace_core.lineage import Registry, RegistryError

    name, sep, version = ref[len("registry:"):].partition("@")
    if not sep or not name or not version:
        raise ModelRefError(f"--model {ref!r}: write registry:NAME@VERSION (see `envace registry list`)")
    reg = Registry(registry_root)
    try:
        manifest = reg.show(name, version)
        bad = reg.verify(name, version)
    except RegistryError as e:
        raise ModelRefError(f"--model {ref!r}: {e}") from e
    if bad:
        raise ModelRefError(f"--model {ref!r} fails verification, refusing to use it; artifacts that differ "
                            f"from the manifest: {', '.join(bad)}")
    adapter = reg.version_dir(name, version) / "artifacts" / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise ModelRefError(f"--model {ref!r}: no LoRA adapter at {adapter}")
    base = (manifest.get("base_model") or {}).get("ref")
    if not base:
        raise ModelRefError(f"--model {ref!r}: the manifest names no base_model.ref")
    return ResolvedModel(ref=ref, base_ref=base, adapter_dir=str(adapter), manifest=manifest)


def check_model_ref(ref: str, cfg: RunConfig, registry: str | None = None) -> ResolvedModel:
    """`resolve_model_ref` (adapter folders checked by `check_adapter_dir`) plus the base model's folder
    (`models.resolve_model`): everything short of loading weights, so scripts can fail before hours of
    work. An ``s3://`` base is left to load time (checking it would download it). Raises `ModelRefError`,
    `AdapterError` or `models.ModelNotFoundError`."""
    from envace_core.models import resolve_model

    model = resolve_model_ref(ref, registry or cfg.store.registry, base_ref=cfg.model.ref)
    if not model.base_ref.startswith("s3://"):
        resolve_model(model.base_ref)
    return model


def load_engine(cfg: RunConfig, model: ResolvedModel):
    """(HFEngine, parameter count) for `model`; a registry model's base weights must match the manifest's
    ``base_model.sha256`` (`models.model_fingerprint`), else `ModelRefError`."""
    from envace_core import stages
    from envace_core.models import model_fingerprint

    cfg = cfg.model_copy(deep=True)
    cfg.model.ref = model.base_ref
    policy, tok, base_dir = stages.load_policy(cfg, model.adapter_dir)
    want = ((model.manifest or {}).get("base_model") or {}).get("sha256")
    if want and model_fingerprint(base_dir) != want:
        raise ModelRefError(f"--model {model.ref!r}: the base model {model.base_ref} at {base_dir} is not the one "
                            "it was trained on (weights sha256 differs from the manifest's base_model.sha256)")
    n_params = sum(p.numel() for p in policy.parameters())
    return stages.policy_engine(cfg, policy, tok), n_params


# ----------------------------------------------------------------------------------------- options
@dataclass
class EvalOptions:
    """What `envace eval` takes (see the CLI help). `limit`: first N tasks/entries/samples per bench (None =
    all); `trials`: k for pass^k (tau2, VitaBench); `split`: tau2 only (the other benches have one set);
    `max_steps`: tau2 orchestrator steps (agent + user messages); `user_url_model`:
    the model name sent to `user_url`; `judge_url`/`judge_model`: VitaBench rubric judge (default: the user
    simulator)."""

    model: str
    benches: str
    out: str
    rehearsal: str = "none"
    user_model: str | None = None
    user_url: str | None = None
    user_url_model: str = "default"
    judge_model: str | None = None
    judge_url: str | None = None
    trials: int = 1
    split: str = "test"
    limit: int | None = None
    max_steps: int = 30
    user_max_new_tokens: int = 128
    seed: int = 0
    profile: str = "cpu-smoke"
    overrides: str = ""
    registry: str | None = None

    def check(self) -> None:
        if self.trials < 1:
            raise EnvaceError(f"--trials must be >= 1, got {self.trials}")
        if self.split not in SPLITS:
            raise EnvaceError(f"--split {self.split!r}: choose one of {', '.join(SPLITS)}")
        if self.limit is not None and self.limit < 1:
            raise EnvaceError(f"--limit must be >= 1 (or omitted for all), got {self.limit}")
        if self.max_steps < 2:
            raise EnvaceError(f"--max-steps must be >= 2, got {self.max_steps}")
        if self.user_model and self.user_url:
            raise EnvaceError("give at most one of --user-model and --user-url")
        if self.judge_model and self.judge_url:
            raise EnvaceError("give at most one of --judge-model and --judge-url")


def fingerprint(opts: EvalOptions, cfg: RunConfig, model: ResolvedModel) -> str:
    """sha256 (16 hex) of the settings that change results (module docstring)."""
    keep = {k: v for k, v in asdict(opts).items() if k not in ("benches", "out", "limit", "trials", "split")}
    keep["model_version"] = (model.manifest or {}).get("version")
    if model.adapter_dir and model.manifest is None:  # a local adapter folder: its content, not its path
        from envace_core.storage import dir_checksums

        keep["adapter_sha256"] = hashlib.sha256(json.dumps(dir_checksums(model.adapter_dir),
                                                           sort_keys=True).encode()).hexdigest()
    keep["config"] = {k: cfg.to_dict()[k] for k in ("model", "data", "rollout", "rehearsal", "eval")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
    if domain == "mock":
        return "base"
    if split == "full":
        return "full" if domain == "telecom" else "base"
    return "test"


# ------------------------------------------------------------------------------------------ judge
class LLMJudge:
    """VitaBench's rubric judge on a local `Engine` or an `OpenAIChatClient` (one call per window).

    It sees the window's messages, the rubrics and their current states, and must answer with a JSON list
    of booleans (one per rubric); an answer that does not parse keeps the current states and is counted in
    `stats["unparsed"]` (VitaBench's judge prompt is not available offline: this prompt is ours).
    """

    def __init__(self, engine=None, client=None, max_new_tokens: int = 128):
        self.engine, self.client, self.max_new_tokens = engine, client, max_new_tokens
        self.stats: Counter = Counter(calls=0, unparsed=0)

    def _ask(self, chat: list[dict]) -> str:
        from envace_core.engines.base import SamplingParams

        if self.client is not None:
            return self.client.chat(chat, self.max_new_tokens, 0.0, 0)
        tok = self.engine.tokenizer
        ids = [int(i) for i in tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)]
        c = self.engine.generate([ids], SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0))[0][0]
        return tok.decode(c.token_ids, skip_special_tokens=True)

    def __call__(self, window: list, rubrics: list[str], states: list[bool]):
        self.stats["calls"] += 1
        convo = "\n".join(f"[{m['role']}] {m['content']}" for m in window)
        items = "\n".join(f"{i}. [{'met' if s else 'unmet'}] {r}" for i, (r, s) in enumerate(zip(rubrics, states)))
        chat = [{"role": "system", "content": "You grade a customer-service agent's conversation against rubrics. "
                 "Answer with only a JSON list of true/false, one per rubric, in order."},
                {"role": "user", "content": f"Conversation excerpt:\n{convo}\n\nRubrics (current state):\n{items}"}]
        text = self._ask(chat)
        m = re.search(r"\[[^\[\]]*\]", text)
        try:
            vals = json.loads(m.group(0)) if m else None
        except json.JSONDecodeError:
            vals = None
        if not isinstance(vals, list) or len(vals) != len(rubrics) or not all(isinstance(v, bool) for v in vals):
            self.stats["unparsed"] += 1
            return {}
        return vals


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
        """A `RehearsalAgent` with the `--rehearsal` mode/n and the config's memory budget, verifier,
        re-entry and temperatures; None for mode "none"."""
        if self.mode == "none":
            return None
        from envace_core import stages
        from envace_core.rehearsal import RehearsalAgent
        from envace_core.verifier import default_checks

        c = self.cfg
        act = stages.rollout_params(c, temperature=c.eval.temperature, max_turns=c.eval.max_turns)
        reh = stages.rollout_params(c, temperature=c.rehearsal.temperature, max_turns=c.eval.max_turns)
        return RehearsalAgent(self.engine, self.mode, self.n, c.rehearsal.memory_max_tokens, act, reh,
                              seed=self.opts.seed, verifier=default_checks(domain) if c.rehearsal.verifier else None,
                              reenter=c.rehearsal.reenter)


def run_tau2_bench(ctx: _Ctx, domain: str) -> dict:
    """tau2 `domain` through `run_tau2`, one task at a time (progress bar; cached per (task, trial))."""
    from envace_core.envs.tau2 import load_tasks
    from envace_core.evaluation.tau2 import run_tau2, summarize

    split = _tau2_split(domain, ctx.opts.split)
    tasks = load_tasks(domain, split, ctx.opts.limit)
    cache = ctx.cache / f"tau2_{domain}.jsonl"
    c = ctx.cfg
    results: list[dict] = []
    for task in _progress(tasks, f"tau2:{domain}", len(tasks)):
        r = run_tau2(ctx.engine, domain, task_ids=[task.id], split=split, trials=ctx.opts.trials,
                     user_engine=ctx.user_engine, user_client=ctx.user_client,
                     rehearsal=ctx.rehearsal_agent(domain), max_steps=ctx.opts.max_steps, seed=ctx.opts.seed,
                     cache_path=cache,
                     agent_kwargs={"max_new_tokens": c.rollout.max_new_tokens_act, "temperature": c.eval.temperature,
                                   "policy_max_chars": c.data.policy_max_chars},
                     user_kwargs={"max_new_tokens": ctx.opts.user_max_new_tokens})
        ctx.count(f"tau2:{domain}", len(r["results"]) - r["skipped"], r["skipped"])
        results += r["results"]
    summary = summarize(results, ctx.opts.trials).get(domain, {})
    return {"bench": "tau2", "name": domain, "split": split, "summary": summary,
            "results": results}


def _bfcl_report(categories: dict, limit: int | None):
    """A `BfclReport` over already-scored categories, with bfcl's groups and overall (`overall_scores`;
    the same composition `evaluate_bfcl` ends with)."""
    from envace_core.evaluation.bfcl import BfclReport, _leaves, overall_scores

    rep = BfclReport(categories=categories, limit_per_category=limit)
    scores = {c: {"accuracy": r.accuracy, "total_count": r.n} for c, r in categories.items() if r.n}
    overall, rep.groups = overall_scores(scores)
    rep.overall = float(overall["accuracy"]) if overall else 0.0
    ev, rep.groups_evaluated = overall_scores(scores, only_evaluated=True)
    rep.overall_evaluated = None if ev is None else float(ev["accuracy"])
    rep.missing_categories = [c for c in _leaves() if c not in scores]
    rep.complete = not rep.missing_categories and limit is None
    return rep


def _bfcl_multi_turn(ctx: _Ctx, cat: str):
    """A multi-turn category's first `limit` entries through `run_multi_turn`, with Private Rehearsal when
    ``--rehearsal`` asks for it; each scored entry is appended to ``bfcl_<cat>.jsonl`` at once, so a rerun
    plays only the entries not there yet."""
    from envace_core.evaluation.bfcl import (
        CategoryResult,
        EntryResult,
        _tally,
        load_bfcl,
        run_multi_turn,
        sampling_params,
    )

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
    return _tally(CategoryResult(category=cat, entries=[have[e.id] for e in entries]))


def run_bfcl_benches(ctx: _Ctx, categories: list[str]) -> dict:
    """BFCL categories through `evaluate_bfcl` (cached per (category, limit)) or, multi-turn ones,
    `_bfcl_multi_turn` (cached per entry); one report with bfcl's overall."""
    from envace_core.evaluation.bfcl import (
        MULTI_TURN_CATEGORIES,
        CategoryResult,
        evaluate_bfcl,
    )

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
    from envace_core.evaluation.vita import (
        VitaEnvironment,
        judge_reward,
        load_vitabench,
        vita_context,
        vita_metrics,
    )

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
            agent = ctx.rehearsal_agent(task.domain) or _plain_agent(ctx)
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


def _plain_agent(ctx: _Ctx):
    from envace_core import stages
    from envace_core.rehearsal import RehearsalAgent

    c = ctx.cfg
    act = stages.rollout_params(c, temperature=c.eval.temperature, max_turns=c.eval.max_turns)
    return RehearsalAgent(ctx.engine, "none", 0, c.rehearsal.memory_max_tokens, act, act, seed=ctx.opts.seed)


def run_finmcp_bench(ctx: _Ctx, path: str) -> dict:
    """FinMCP-Bench samples at `path` through `evaluate_finmcp`, one sample at a time (cached per sample);
    micro/macro TF1 and tool precision recomputed over all samples with `finmcp_metrics`."""
    from envace_core.evaluation import finmcp

    samples = finmcp.load_finmcp(path)[: ctx.opts.limit]
    cache = ctx.cache / f"finmcp_{_path_key(path)}.jsonl"
    have = {r["sample"]["id"]: r for r in read_jsonl(cache, _finmcp_record)}
    rows = []
    for s in _progress(samples, "finmcp", len(samples)):
        if s.id in have:
            rows.append(have[s.id])
            ctx.count("finmcp", 0, 1)
            continue
        r = finmcp.evaluate_finmcp(ctx.engine, [s], max_new_tokens=ctx.cfg.rollout.max_new_tokens_act,
                                   temperature=ctx.cfg.eval.temperature, seed=ctx.opts.seed)
        row = {"sample": r["samples"][0], "decode": r["decode"]}
        _append_jsonl(cache, row)
        rows.append(row)
        ctx.count("finmcp", 1, 0)
    per = [r["sample"] for r in rows]
    overall = finmcp.finmcp_metrics([(p["tp"], p["fp"], p["fn"]) for p in per])
    decode: Counter = Counter()
    for r in rows:
        decode.update({k: v for k, v in r["decode"].items() if isinstance(v, int)})
    return {"bench": "finmcp", "name": path, "n_samples": len(per), "micro": overall["micro"],
            "macro": overall["macro"], "by_task": finmcp._group(per, "task"), "decode": dict(decode),
            "published": dict(finmcp.PUBLISHED)}


# -------------------------------------------------------------------------------------------- run
def _user(opts: EvalOptions, cfg: RunConfig, engine):
    """(user engine, user client, description) from --user-model / --user-url (default: the policy)."""
    from envace_core.evaluation.tau2 import OpenAIChatClient

    if opts.user_url:
        return None, OpenAIChatClient(opts.user_url, opts.user_url_model), \
            f"OpenAI-compatible endpoint {opts.user_url} (model {opts.user_url_model})"
    if opts.user_model:
        ref = resolve_model_ref(opts.user_model, opts.registry or cfg.store.registry, base_ref=cfg.model.ref)
        user_engine, n = load_engine(cfg, ref)
        return user_engine, None, f"{opts.user_model} ({n / 1e6:.0f}M parameters) through our engine"
    return engine, None, "the evaluated policy itself (its own engine)"


def _judge(opts: EvalOptions, cfg: RunConfig, user_engine, user_client, user_desc: str):
    from envace_core.evaluation.tau2 import OpenAIChatClient

    if opts.judge_url:
        return LLMJudge(client=OpenAIChatClient(opts.judge_url, opts.user_url_model)), f"endpoint {opts.judge_url}"
    if opts.judge_model:
        ref = resolve_model_ref(opts.judge_model, opts.registry or cfg.store.registry, base_ref=cfg.model.ref)
        eng, _ = load_engine(cfg, ref)
        return LLMJudge(engine=eng), opts.judge_model
    return LLMJudge(engine=user_engine, client=user_client), f"the user simulator ({user_desc})"


def run_eval(opts: EvalOptions, *, engine=None, n_params: int | None = None,
             log: Callable[[str], None] = print) -> dict:
    """Evaluate `opts.model` on `opts.benches` and return the JSON-able results (what `report.write_report`
    renders). `engine`: an already-built policy engine (tests); default: loaded from `opts.model`.

    Raises `BenchSpecError`, `ModelRefError`, `EnvaceError` (bad options) before any model loads.
    """
    opts.check()
    specs = parse_benches(opts.benches)
    mode, n = parse_rehearsal(opts.rehearsal)
    cfg = load_config(opts.profile, opts.overrides)
    model = resolve_model_ref(opts.model, opts.registry or cfg.store.registry, base_ref=cfg.model.ref)
    fp = fingerprint(opts, cfg, model)
    cache = Path(opts.out).expanduser() / "cache" / fp
    t0 = time.perf_counter()
    if engine is None:
        engine, n_params = load_engine(cfg, model)
    user_engine, user_client, user_desc = _user(opts, cfg, engine)
    judge, judge_desc = _judge(opts, cfg, user_engine, user_client, user_desc) \
        if any(s.bench == "vita" for s in specs) else (None, None)
    load_s = time.perf_counter() - t0
    log(f"[eval] model {model.label}; rehearsal {opts.rehearsal}; user {user_desc}; cache {cache}")
    ctx = _Ctx(opts, cfg, mode, n, engine, user_engine, user_client, judge, cache)
    benches: list[dict] = []
    bench_seconds: dict[str, float] = {}
    bfcl_cats = [s.arg for s in specs if s.bench == "bfcl"]
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
    return {
        "model": {"ref": model.ref, "base": model.base_ref, "adapter": model.adapter_dir, "label": model.label,
                  "n_params": n_params, "registry_version": (model.manifest or {}).get("version")},
        "settings": {"benches": [s.label for s in specs],
                     "rehearsal": {"mode": mode, "n": n, "applies_to": REHEARSAL_APPLIES_TO},
                     "trials": opts.trials, "split": opts.split, "limit": opts.limit, "max_steps": opts.max_steps,
                     "seed": opts.seed, "profile": opts.profile, "overrides": opts.overrides},
        "user_simulator": user_desc, "judge": judge_desc, "fingerprint": fp, "cache": str(cache),
        "protocol": {"tau2": "tau2 Orchestrator + evaluate_simulation; NL assertions skipped (no judge offline)",
                     "bfcl": "bfcl-eval AST / multi-turn checkers; Private Rehearsal (as --rehearsal) in "
                             "multi-turn categories only, single-turn categories never rehearse",
                     "vita": "opening request only, generated read-only tools (not the official ones), "
                             "rubric judge as configured",
                     "finmcp": "gold history up to each user turn; tool-name TF1 / precision; no rehearsal"},
        "benches": benches, "work": ctx.work,
        "seconds": {"load": load_s, **bench_seconds, "total": time.perf_counter() - t0},
    }
