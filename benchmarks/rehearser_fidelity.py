"""REHEARSE fidelity on held-out real transitions: base vs ACT-only vs ACT+REHEARSE warm starts, grounding k.

Run by hand (one long torch job; resumable):

    nice -n 5 env OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rehearser_fidelity.py \
        [--limit 100] [--conditions base-k0,act-k0,...] [--sft-steps 24] [--dtype auto|float32|bfloat16]

(--conditions also limits the written JSON to those conditions: rewrite it with --report-only and the
default conditions after a partial run.)

--dtype (default auto: bfloat16 on a CPU with native bf16, else float32) is the compute dtype of the
warm starts and of generation. Results of the two dtypes are cached apart (bf16 keys and warm-start
folders end in "-bf16"), and the latest row of a transition is the one reported, so a condition re-run
in the other dtype replaces its results; the JSON gives each condition's rows per dtype. On an
AVX2-only CPU pass --dtype bfloat16 to reuse bf16 rows (bf16 is ~4x slower there).

Held-out transitions (never in a warm start): the gold actions of the tau2 test split (airline +
retail) replayed in the real environment, of real train-split tasks held out from the warm start and
of synthesized tasks held out likewise, plus the tool errors that wrong calls of those tasks produce
(`training.transitions.real_transitions`, errors=True). The warm starts train on the remaining
train-split tasks (real and synthesized) only; grounding examples come from those same warm-start
tasks' transitions (`roles.grounding.GroundingIndex`: other tasks, same tool).

Conditions ``<warm>-k<k>``: warm ∈ base (no warm start), act (today's ACT-only SFT warm start),
act_rehearse (ACT + REHEARSE SFT on real transitions, one wrong call's error per gold call: about half
errors), act_rehearse_bal (the same with errors subsampled to BAL_ERROR_SHARE of the REHEARSE
examples), act_rehearse_wide / act_rehearse_bal_wide (capacity variants: LoRA on all linear layers,
r = 64); k ∈ {0, 2, 4} grounding examples. Generation: greedy, per-tool REHEARSE
budgets, batched 8 rows of similar budget. Each (condition, transition) result is appended to
benchmarks/results/rehearser_fidelity.jsonl (keyed by the condition, the transition id and a hash of
the prompt, so a changed prompt is re-generated); a restart skips the done ones. Metrics:
`evaluation.fidelity` (95 % percentile bootstrap CIs over transitions). Writes
benchmarks/results/rehearser_fidelity.json and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import sys
import time
from itertools import zip_longest
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
CACHE = RESULTS / "rehearser_fidelity.jsonl"
OUT = RESULTS / "rehearser_fidelity.json"
WORK = ROOT / ".envace" / "bench" / "rehearser_fidelity"
DOMAINS = ("airline", "retail")
WARMS = ("base", "act", "act_rehearse", "act_rehearse_wide", "act_rehearse_bal", "act_rehearse_bal_wide")
# share of wrong-call errors among the REHEARSE examples of the "_bal" warm starts (sft.rehearse_examples'
# error_share): the others keep one error per gold call, about half
BAL_ERROR_SHARE = 0.25
# most informative first (a run cut short still answers "does the REHEARSE warm start help?")
DEFAULT_CONDITIONS = ["act_rehearse-k0", "act-k0", "act_rehearse-k4", "base-k0", "act_rehearse-k2", "base-k2",
                      "act-k2", "base-k4", "act-k4", "act_rehearse_wide-k0", "act_rehearse_bal-k0"]
BATCH = 8  # rows per generate call
# > 0: the engine's prefix KV pool, in tokens (≈ 46 KB of float32 KV per token for SmolLM2-135M)
PREFIX_CACHE_TOKENS = int(os.environ.get("FIDELITY_PREFIX_CACHE_TOKENS", "0"))
DTYPE = "float32"  # set by --dtype in main(); the warm start's and the engine's compute dtype
# float32 keeps the names and cache keys it had before --dtype existed
DTYPE_SUFFIX = {"float32": "", "bfloat16": "-bf16"}
GOAL = {"json_valid": 0.95, "error_match": 0.90, "key_f1": 0.80, "value_f1": 0.50}
# rows written before they recorded their warm start's SFT steps all came from 24-step warm starts
OLD_ROWS_SFT_STEPS = 24


def row_sft_steps(row: dict[str, Any]) -> int | None:
    """The SFT steps of the warm start a cached row was generated with (None: the base model)."""
    if row["condition"].startswith("base-"):
        return None
    return row.get("sft_steps", OLD_ROWS_SFT_STEPS)


def cached_rows(steps: int) -> list[dict[str, Any]]:
    """The cache's rows that belong to a run with `steps` SFT steps (base-model rows always do)."""
    rows = [json.loads(line) for line in CACHE.read_text().splitlines()] if CACHE.exists() else []
    return [r for r in rows if row_sft_steps(r) in (None, steps)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ data
def split_tasks(n_real_held: int, n_synth: int, n_synth_held: int):
    """(warm-start train tasks, held-out tasks) over airline + retail: the last `n_real_held` real
    train-split tasks of each domain and `n_synth_held` of its `n_synth` synthesized ones are held
    out with the whole test split; the rest trains the warm starts."""
    from envace_core.envs.tau2.synth import synthesize
    from envace_core.envs.tau2.tasks import load_tasks

    train, held = [], []
    for d in DOMAINS:
        real = [t for t in load_tasks(d, "train") if t.gold_actions]
        test = [t for t in load_tasks(d, "test") if t.gold_actions]
        synth = synthesize(d, n_synth, seed=7, test_tasks=load_tasks(d, "test"))
        train += real[:-n_real_held] + synth[:-n_synth_held]
        held += real[-n_real_held:] + synth[-n_synth_held:] + test
    assert not {t.id for t in train} & {t.id for t in held}
    assert not any(t.split == "test" for t in train)
    return train, held


def transition_id(tr) -> str:
    h = hashlib.sha1(json.dumps([tr.kind, tr.call.name, tr.call.arguments, len(tr.history)],
                                sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{tr.task_id}#{h}"


def _source(task_id: str) -> str:
    return "synthesized" if task_id.split("/", 1)[-1].startswith("synth-") else f"tau2 {TASKS[task_id].split} split"


def pick_held_out(trans: list, n: int) -> list:
    """`n` transitions spread round-robin over (domain, tool, kind) groups, each group's own order
    alternating between the sources (synthesized, real train split, test split); deterministic."""
    groups: dict[tuple, list] = {}
    for tr in sorted(trans, key=transition_id):
        groups.setdefault((tr.domain, tr.tool, tr.observation.error), []).append(tr)
    for key, items in groups.items():
        by_src: dict[str, list] = {}
        for tr in items:
            by_src.setdefault(_source(tr.task_id), []).append(tr)
        lanes = [by_src[s] for s in sorted(by_src)]
        groups[key] = [tr for row in zip_longest(*lanes) for tr in row if tr is not None]
    out, keys = [], sorted(groups)
    while len(out) < n and any(groups.values()):
        for k in keys:
            if groups[k] and len(out) < n:
                out.append(groups[k].pop(0))
    return out


# ------------------------------------------------------------------------------------ warm start
def warm_adapter(warm: str, cfg, train_trans: list, train_tasks: list, steps: int,
                 budgets: dict[str, int]) -> str | None:
    """The adapter dir of warm start `warm` (trained once, then reused from WORK/<warm>)."""
    if warm == "base":
        return None
    out = WORK / (f"{warm}-s{steps}" + DTYPE_SUFFIX[DTYPE])
    if (out / "adapter_config.json").exists():
        return str(out)
    from envace_core.training.policy import load_policy
    from envace_core.training.sft import act_examples, rehearse_examples, sft_warmup
    from envace_core.training.trainer import PolicyTrainer

    tcfg = cfg.train
    if warm.endswith("_wide"):
        tcfg = tcfg.model_copy(update={"lora_r": 64, "lora_alpha": 64, "lora_target_modules": [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})
    model, tok, _ = load_policy(cfg)
    trainer = PolicyTrainer(model, tok, tcfg, compute_dtype=DTYPE)
    ex = act_examples(train_tasks, tok, cfg.data.policy_max_chars, max_turns=cfg.rollout.max_turns,
                      max_tokens=cfg.train.sft_max_tokens)
    if warm != "act":
        ex = ex + rehearse_examples(train_trans, tok, train_tasks, cfg.data.policy_max_chars, budgets=budgets,
                                    default_budget=cfg.rollout.max_new_tokens_rehearse,
                                    max_observation_tokens=cfg.rollout.max_observation_tokens,
                                    max_tokens=cfg.train.sft_max_tokens,
                                    error_share=BAL_ERROR_SHARE if "_bal" in warm else None)
    t0 = time.time()
    losses = sft_warmup(trainer, ex, steps, cfg.train.sft_learning_rate, cfg.train.sft_batch_rows, seed=0,
                        log=lambda s: log(f"{warm}: {s}") if s.split("/")[0].endswith("0") else None)
    trainer.save_adapter(str(out))
    log(f"{warm}: {steps} SFT steps on {len(ex)} examples in {time.time() - t0:.0f}s, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    (out / "sft.json").write_text(json.dumps({"examples": len(ex), "rehearse_examples": sum(e.role == "rehearse" for e in ex),
                                              "rehearse_errors": sum(e.role == "rehearse" and e.text.lstrip().startswith('{"error"')
                                                                     for e in ex), "steps": steps, "losses": losses,
                                              "seconds": time.time() - t0, "dtype": DTYPE}))
    return str(out)


# ------------------------------------------------------------------------------------ generation
def run_condition(cond: str, cfg, adapter_of, held: list, index, budgets: dict[str, int],
                  done: set[str], sink, steps: int) -> None:
    """Generate and score `cond`'s held-out transitions that are not in `done` yet; `adapter_of()`
    gives the warm start's adapter dir (None for the base model) and is called only when some
    transition is left, so a condition whose results are all cached never trains its warm start."""
    from envace_core.engines.base import SamplingParams
    from envace_core.engines.hf import HFEngine
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.models import load_tokenizer, resolve_model
    from envace_core.roles.json_prefix import NotJsonStop
    from envace_core.roles.rehearse import rehearse_prompt_ids
    from envace_core.training.policy import load_policy

    k = int(cond.rsplit("-k", 1)[1])
    tok = load_tokenizer(resolve_model(cfg.model.ref))
    tasks = {}
    todo = []
    for tr in held:
        if tr.task_id not in tasks:
            tasks[tr.task_id] = task_context(TASKS[tr.task_id], cfg.data.policy_max_chars)
        ex = index.examples(tr.task_id, tr.call, k, cfg.rollout.grounding_max_tokens, tok) if k else []
        ids = rehearse_prompt_ids(tok, tasks[tr.task_id], tr.history, tr.call, ex,
                                  max_observation_tokens=cfg.rollout.max_observation_tokens)
        key = f"{cond}|{transition_id(tr)}|{hashlib.sha1(str(ids).encode()).hexdigest()[:10]}{DTYPE_SUFFIX[DTYPE]}"
        if key not in done:
            todo.append((key, tr, ids))
    log(f"{cond}: {len(held) - len(todo)} cached, {len(todo)} to generate")
    if not todo:
        return
    model, tok, _ = load_policy(cfg, adapter_of())
    # optional prefix caching (FIDELITY_PREFIX_CACHE_TOKENS > 0): a prompt reuses the KV of the longest
    # prefix it shares with an earlier one (the domain's system prompt, the same task's history);
    # float32 greedy outputs equal re-encoding. Off by default: on a 2-core AVX2 CPU it measured no
    # faster (≈ 0.5 s per decode step at batch 8 either way; RESULTS.md)
    engine = HFEngine(model, tok, compute_dtype=DTYPE, prefix_cache_tokens=PREFIX_CACHE_TOKENS)

    def budget_of(tr) -> int:
        return budgets.get(tr.tool, cfg.rollout.max_new_tokens_rehearse)

    from envace_core.evaluation.fidelity import score_pair

    # chunks of BATCH rows, short budgets (≤ 200 tokens) first, each class by prompt length (little
    # padding; a task's shorter, earlier prompts reach the prefix cache before its later ones): each
    # chunk decodes to its largest budget and each row is then cut to its own, which is the row's
    # greedy output at its budget (decoding is causal and greedy: the first b tokens do not depend on
    # the budget)
    todo.sort(key=lambda it: (budget_of(it[1]) > 200, len(it[2])))
    for i in range(0, len(todo), BATCH):
        chunk = todo[i:i + BATCH]
        budget = max(budget_of(tr) for _, tr, _ in chunk)
        t0 = time.time()
        outs = engine.generate([ids for _, _, ids in chunk],
                               SamplingParams(max_new_tokens=budget, temperature=0.0, role="rehearse",
                                              stop_when=NotJsonStop(tok)))
        dt = time.time() - t0
        for (key, tr, ids), o in zip(chunk, outs):
            new = list(o[0].token_ids)[:budget_of(tr)]
            text = tok.decode(new, skip_special_tokens=True)
            s = score_pair(tr.observation, text, tr.call)
            sink.write(json.dumps({"key": key, "condition": cond, "id": transition_id(tr),
                                   "sft_steps": None if cond.startswith("base-") else steps,
                                   "domain": tr.domain, "dtype": DTYPE, "prompt_tokens": len(ids),
                                   "new_tokens": len(new), "budget": budget_of(tr),
                                   "seconds": dt / len(chunk), "text": text, **s.to_dict()}) + "\n")
            sink.flush()
            done.add(key)
        log(f"{cond}: {min(i + BATCH, len(todo))}/{len(todo)} at budget <= {budget} "
            f"({dt:.1f}s, {sum(len(o[0].token_ids) for o in outs)} tokens)")
    del engine, model


# ------------------------------------------------------------------------------------------ report
def report(conditions: list[str], held: list, steps: int) -> dict[str, Any]:
    """condition -> metric -> {mean, ci_low, ci_high, n}, "per_tool", "per_kind", generated tokens and
    seconds per transition, from the cache; each output is re-scored from its stored text with the
    current `evaluation.fidelity` (the latest prompt's result of a transition wins)."""
    from envace_core.evaluation.fidelity import aggregate, score_pair

    by_id = {transition_id(tr): tr for tr in held}
    rows: dict[str, dict[str, dict]] = {}
    for r in cached_rows(steps):
        if r["condition"] in conditions and r["id"] in by_id:
            rows.setdefault(r["condition"], {})[r["id"]] = r
    out: dict[str, Any] = {}
    for cond in conditions:
        rs = list(rows.get(cond, {}).values())
        if not rs:
            continue
        scores = [score_pair(by_id[r["id"]].observation, r["text"], by_id[r["id"]].call) for r in rs]
        agg = aggregate(scores)
        out[cond] = {**agg["all"], "per_tool": agg["per_tool"], "per_kind": agg["per_kind"],
                     "generated_tokens_mean": sum(r["new_tokens"] for r in rs) / len(rs),
                     "hit_budget": sum(r["new_tokens"] >= r["budget"] for r in rs) / len(rs),
                     "seconds_per_transition": sum(r["seconds"] for r in rs) / len(rs),
                     # rows written before the dtype was recorded ran in float32
                     "dtype": {d: sum(r.get("dtype", "float32") == d for r in rs)
                               for d in sorted({r.get("dtype", "float32") for r in rs})}}
    return out


def table(res: dict[str, Any]) -> str:
    cols = ["json_valid", "error_match", "key_f1", "value_f1", "echo_f1", "imagined_f1"]
    lines = ["| condition | n | " + " | ".join(cols) + " | tokens/transition |",
             "|---|---|" + "---|" * len(cols) + "---|"]
    for cond, m in res.items():
        cells = [f"{m[c]['mean']:.3f} [{m[c]['ci_low']:.2f}, {m[c]['ci_high']:.2f}]"
                 if m[c]["mean"] is not None else "–" for c in cols]
        lines.append(f"| {cond} | {m['json_valid']['n']} | " + " | ".join(cells)
                     + f" | {m['generated_tokens_mean']:.0f} |")
    return "\n".join(lines)


TASKS: dict[str, Any] = {}


def source_counts(held: list) -> dict[str, int]:
    """Held-out transitions per source: tau2 test split, real train split, synthesized."""
    out: dict[str, int] = {}
    for tr in held:
        out[_source(tr.task_id)] = out.get(_source(tr.task_id), 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=100, help="held-out transitions (>= 100 for the report)")
    ap.add_argument("--conditions", default=",".join(DEFAULT_CONDITIONS))
    ap.add_argument("--sft-steps", type=int, default=24,
                    help="SFT steps of each warm start (cached rows of other step counts are not reused)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="compute dtype of the warm starts and of generation; auto = bfloat16 on a CPU with "
                         "native bf16 (AVX-512 BF16 / AMX), else float32 (engines.base.resolve_compute_dtype)")
    a = ap.parse_args()
    conditions = list(dict.fromkeys(c.strip() for c in a.conditions.split(",") if c.strip()))
    if a.limit < 1:
        ap.error(f"--limit must be >= 1, got {a.limit}")
    if a.sft_steps < 1:
        ap.error(f"--sft-steps must be >= 1, got {a.sft_steps}")
    if not conditions:
        ap.error("--conditions names no condition")
    for c in conditions:
        w, _, k = c.rpartition("-k")
        if w not in WARMS or not k.isdigit() or int(k) > 8:
            ap.error(f"--conditions: {c!r} is not <warm>-k<k> with warm in {WARMS} and k in 0..8 "
                     "(grounding examples per prompt)")

    import torch

    from envace_core.config import load_config
    from envace_core.engines.base import resolve_compute_dtype

    global DTYPE
    DTYPE = resolve_compute_dtype(a.dtype, "cpu")
    from envace_core.roles.grounding import GroundingIndex
    from envace_core.training.transitions import real_transitions

    torch.manual_seed(0)
    # per-tool budgets measured on the warm-start transitions (`rehearse_budgets`), as every recorded
    # row used them, whatever the profile's table is
    cfg = load_config("cpu-smoke", {"model": {"compute_dtype": DTYPE},
                                    "rollout": {"max_new_tokens_rehearse_per_tool": {}},
                                    "train": {"sft_batch_rows": 4, "sft_learning_rate": 5e-4}})
    t0 = time.time()
    setup = WORK / "setup.pkl"  # tasks and their replayed transitions: deterministic, so made once
    if setup.exists():
        train, held_tasks, train_trans, held_all = pickle.loads(setup.read_bytes())
    else:
        train, held_tasks = split_tasks(n_real_held=4, n_synth=12, n_synth_held=4)
        train_trans = real_transitions(train, errors=True, seed=0)
        held_all = real_transitions(held_tasks, errors=True, seed=0, forbid_splits=())
        WORK.mkdir(parents=True, exist_ok=True)
        setup.write_bytes(pickle.dumps((train, held_tasks, train_trans, held_all)))
    TASKS.update({t.id: t for t in train + held_tasks})
    held = pick_held_out(held_all, a.limit)
    assert not {tr.task_id for tr in held} & {t.id for t in train}
    log(f"{len(train)} warm-start tasks ({len(train_trans)} transitions), {len(held)} held-out transitions "
        f"({sum(tr.observation.error for tr in held)} errors) in {time.time() - t0:.0f}s")
    budgets = rehearse_budgets(cfg, train_trans)
    if not a.report_only:
        index = GroundingIndex(train_trans)
        done = {r["key"] for r in cached_rows(a.sft_steps)}
        RESULTS.mkdir(parents=True, exist_ok=True)
        with CACHE.open("a") as sink:
            for cond in conditions:
                warm = cond.rsplit("-k", 1)[0]
                run_condition(cond, cfg, lambda warm=warm: warm_adapter(warm, cfg, train_trans, train, a.sft_steps, budgets),
                              held, index, budgets, done, sink, a.sft_steps)
                write_report(conditions, held, train, a, cfg, budgets)  # after each condition: partial runs count
    print(write_report(conditions, held, train, a, cfg, budgets))


def write_report(conditions: list[str], held: list, train: list, a, cfg, budgets: dict[str, int]) -> str:
    """Write OUT from the cache (the conditions done so far) and return the table."""
    res = report(conditions, held, a.sft_steps)
    meta = {"held_out_transitions": len(held), "errors": sum(tr.observation.error for tr in held),
            "held_out_by_source": source_counts(held), "warm_start_tasks": len(train),
            "sft_steps": a.sft_steps, "sft_batch_rows": cfg.train.sft_batch_rows,
            "sft_learning_rate": cfg.train.sft_learning_rate, "goal": GOAL, "model": cfg.model.ref,
            "dtype_of_this_run": DTYPE,
            "budgets": budgets, "conditions_asked": conditions}
    OUT.write_text(json.dumps({"meta": meta, "conditions": res}, indent=1) + "\n")
    return table(res)


def rehearse_budgets(cfg, train_trans: list) -> dict[str, int]:
    """{tool: REHEARSE max new tokens}: the profile's `rollout.max_new_tokens_rehearse_per_tool`, else
    measured here as that setting is defined: the 95th percentile of the tool's real results' tokens
    (canonical rendering, warm-start transitions) + 1 for the eos, at most
    `rollout.max_observation_tokens`."""
    import numpy as np

    from envace_core.models import load_tokenizer, resolve_model

    if cfg.rollout.max_new_tokens_rehearse_per_tool:
        return dict(cfg.rollout.max_new_tokens_rehearse_per_tool)
    tok = load_tokenizer(resolve_model(cfg.model.ref))
    lengths: dict[str, list[int]] = {}
    for tr in train_trans:
        lengths.setdefault(tr.tool, []).append(len(tok.encode(tr.observation.content, add_special_tokens=False)))
    cap = cfg.rollout.max_observation_tokens or 1 << 30
    return {t: int(min(cap, np.ceil(np.percentile(v, 95)) + 1)) for t, v in sorted(lengths.items())}


if __name__ == "__main__":
    main()
