"""The `warm_start` stage: the supervised warm start of the policy (METHOD.md §2b), trained once per
warm-start id and kept in the artifact store; `rollout_and_train` starts a fresh run from it.

What it trains: train.init_adapter (if set) copied into a fresh LoRA, then train.sft_warmup_steps
SFT steps (`sft.sft_warmup`) on the warm-up examples of train.sft_roles (`warm_examples`: ACT on
the gold turns of the train tasks, REHEARSE on their real transitions, prompts as the rollouts build
them). A shared policy trains on both roles' examples together; a per-role policy
(train.policy_per_role) warms each adapter on its own role's examples, sft_warmup_steps steps each
(`warm_up`). With train.sft_act_final_steps = n > 0 (a shared policy on both roles) the warm start
has two phases: the mixed one above is a warm start of its own (the same config with n = 0, stored
and reused like any other), then n ACT-only SFT steps start from its adapter (`train_act_final`).

Where it goes: store key ``warm_starts/<warm_start_id>`` (`WARM_START_KEY`), one `put_dir` of
adapter/ (`PolicyTrainer.save_adapter`: act/ + rehearse/ for a per-role policy, the layout
train.init_adapter reads) and warm_start.json (the stage's result). `put_dir` commits atomically
(LocalStore: version folder, CHECKSUMS.json, then one pointer swap; S3Store: the commit object last),
so a killed write leaves no key; a directory there is reused when its warm_start.json names the same id
and every file matches its CHECKSUMS.json (`stored_warm_start`), and refused otherwise (an error naming the
changed files: a damaged warm start is neither used nor silently retrained over).

The warm-start id (`warm_start_id`) hashes what decides the weights: the base model's content
(`models.base_model_lineage`: weight files, or the S3 listing), the train split's version, the LoRA and SFT
settings of train.*, train.init_adapter's content, train.seed and the settings that shape the SFT
prompts and targets (`warm_start_settings`). Settings that only shape the GRPO stage (reward.*,
rollout.source, train.iterations, ...) are not in it, so conditions that differ only there (the
learning benchmark's) share one warm start, and a re-run reuses it without training.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.config_checks import (
    ACT_MEMORY_KINDS,
    effective_act_final_steps,
    effective_act_repeats,
)
from envace_core.store.base import StoreError
from envace_core.store.files import CHECKSUMS, dir_checksums, sha256_bytes
from envace_core.store.uri import init_adapter_dir, open_store
from envace_core.types import Task

# The SFT warm-up's batch order (`sft.batch_order`): part of the warm-start id, so a warm start
# made with another order is not reused.
SFT_BATCHING = "prompt-cluster-v1"

if TYPE_CHECKING:
    from envace_core.training.rollout import RolloutParams
    from envace_core.training.sft import SFTExample
    from envace_core.training.trainer import PolicyTrainer
    from envace_core.training.transitions import Transition

WARM_START_KEY = "warm_starts/{warm_start_id}"
META = "warm_start.json"

# train.* fields that decide the LoRA before any SFT step (its shape, layout and initial weights)
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_target_modules", "policy_per_role", "seed", "init_adapter")
# train.* fields of the SFT warm-up (examples, steps, optimizer; max_grad_norm clips its steps)
SFT_FIELDS = ("sft_warmup_steps", "sft_roles", "sft_error_transitions", "sft_rehearse_error_share",
              "sft_max_rehearse_examples",
              "sft_learning_rate", "sft_batch_rows", "sft_max_tokens", "max_grad_norm")
# settings that shape the SFT prompts and targets (`warm_examples`, `sft.rehearse_examples`)
PROMPT_FIELDS = (("data", "policy_max_chars"), ("data", "test_split"), ("rollout", "max_turns"),
                 ("rollout", "max_new_tokens_rehearse"), ("rollout", "max_new_tokens_rehearse_per_tool"),
                 ("rollout", "max_observation_tokens"), ("rollout", "grounding_k"),
                 ("rollout", "grounding_max_tokens"), ("model", "compute_dtype"))


def warm_start_settings(cfg: RunConfig, dataset: dict[str, Any]) -> dict[str, Any]:
    """{"model.ref", "dataset.train_version", "train.<field>" ...}: the settings that decide the warm start's
    weights (module docstring), by dotted name. With train.sft_warmup_steps = 0 only the LoRA ones
    (`LORA_FIELDS`): no SFT runs, so the SFT and prompt settings cannot change anything."""
    # the train split's records alone decide the examples: a dataset that differs only in its test
    # or held-out tasks shares the warm start (a dataset dict from before train_version: its version)
    out: dict[str, Any] = {"model.ref": cfg.model.ref}
    if dataset.get("train_version"):
        out["dataset.train_version"] = dataset["train_version"]
    else:
        out["dataset.version"] = dataset["version"]
    fields = LORA_FIELDS + (SFT_FIELDS if cfg.train.sft_warmup_steps > 0 else ())
    out.update({f"train.{f}": getattr(cfg.train, f) for f in fields})
    if cfg.train.sft_warmup_steps > 0:
        # only when it changes the warm-up: warm starts made before the field existed (all with 1) keep
        # their ids, and a config where it is unused shares the id of one without it
        if effective_act_repeats(cfg.train) != 1:
            out["train.sft_act_repeats"] = effective_act_repeats(cfg.train)
        if effective_act_final_steps(cfg.train):
            out["train.sft_act_final_steps"] = effective_act_final_steps(cfg.train)
        if cfg.train.sft_act_recovery and "act" in cfg.train.sft_roles:
            out["train.sft_act_recovery"] = True
        if cfg.train.sft_answer_repeats != 1 and "act" in cfg.train.sft_roles:
            out["train.sft_answer_repeats"] = cfg.train.sft_answer_repeats
        if cfg.train.sft_act_memory and "act" in cfg.train.sft_roles:
            out["train.sft_act_memory"] = True
            out["rehearsal.memory_content"] = cfg.rehearsal.memory_content
            out["rehearsal.memory_max_tokens"] = cfg.rehearsal.memory_max_tokens
            if sorted(cfg.train.sft_act_memory_kinds) != sorted(ACT_MEMORY_KINDS):  # other kinds, other examples
                out["train.sft_act_memory_kinds"] = sorted(cfg.train.sft_act_memory_kinds)
        out.update({f"{sec}.{f}": getattr(getattr(cfg, sec), f) for sec, f in PROMPT_FIELDS})
        out["sft.batching"] = SFT_BATCHING  # how steps draw their examples: same settings, other weights
    return out


def warm_start_id(cfg: RunConfig, dataset: dict[str, Any], model_sha256: str) -> str:
    """12 hex digits of sha256 over `warm_start_settings`, the base model's fingerprint `model_sha256`
    (`models.base_model_lineage`) and the file checksums of train.init_adapter (its content, not only
    its path). Raises EnvaceError when train.init_adapter names no directory."""
    key: list[Any] = [warm_start_settings(cfg, dataset), model_sha256]
    if cfg.train.init_adapter:
        key.append(dir_checksums(init_adapter_dir(cfg.train.init_adapter)))
    return sha256_bytes(json.dumps(key, sort_keys=True, default=str).encode())[:12]


def check_warm_start(cfg: RunConfig, dataset: dict[str, Any], warm: dict[str, Any]) -> None:
    """Raise EnvaceError naming every setting in which `warm` (a `warm_start` result) was made
    differently from what `cfg` on `dataset` asks for (`warm_start_settings`), e.g. another
    train.sft_warmup_steps or train.policy_per_role: a run must not start from another config's warm
    start. The base model's content is not re-hashed here (`warm_start_id` covers it)."""
    want, have = warm_start_settings(cfg, dataset), warm.get("settings") or {}
    bad = [f"{k}={have.get(k)!r} (this run: {want.get(k)!r})" for k in sorted(set(want) | set(have))
           if want.get(k) != have.get(k)]
    if bad:
        raise EnvaceError(f"warm start {warm.get('warm_start_id')!r} was made with other settings than this "
                          f"run: {'; '.join(bad)}. Run the warm_start stage with this config and dataset")


def warm_examples(cfg: RunConfig, tasks: list[Task], tokenizer, params: RolloutParams,
                  transitions: list[Transition]) -> dict[str, list[SFTExample]]:
    """The warm-up examples of each role in train.sft_roles: "act" = `sft.act_examples` of the train
    `tasks` (first rollout.max_turns turns, tool results cut to rollout.max_observation_tokens as rollouts
    cut them; each final-answer example train.sft_answer_repeats times; with train.sft_act_recovery also
    `sft.act_recovery_examples`, seed train.seed; with train.sft_act_memory also
    `rehearsal.memory_examples.act_memory_examples` under the rehearsal memory settings and
    train.sft_act_memory_kinds), "rehearse" =
    `sft.rehearse_examples` of `transitions`
    (`loop.real_train_transitions`; prompts as rollouts build them with `params`, grounding included;
    targets cut to the per-tool budgets), both within train.sft_max_tokens; REHEARSE errors capped at
    train.sft_rehearse_error_share of them, then REHEARSE capped at train.sft_max_rehearse_examples."""
    from envace_core.training.sft import act_examples, act_recovery_examples, rehearse_examples

    out: dict[str, list[SFTExample]] = {}
    if "act" in cfg.train.sft_roles:
        kw = {"max_turns": cfg.rollout.max_turns, "max_tokens": cfg.train.sft_max_tokens,
              "forbid_splits": (cfg.data.test_split,), "max_observation_tokens": cfg.rollout.max_observation_tokens}
        out["act"] = act_examples(tasks, tokenizer, cfg.data.policy_max_chars, **kw)
        out["act"] += [e for e in out["act"] if e.gold is None] * (cfg.train.sft_answer_repeats - 1)
        if cfg.train.sft_act_recovery:
            out["act"] += act_recovery_examples(tasks, tokenizer, cfg.data.policy_max_chars, seed=cfg.train.seed, **kw)
        if cfg.train.sft_act_memory:
            from envace_core.rehearsal.memory_examples import act_memory_examples

            out["act"] += act_memory_examples(tasks, tokenizer, cfg.data.policy_max_chars, seed=cfg.train.seed,
                                              memory_max_tokens=cfg.rehearsal.memory_max_tokens,
                                              memory_content=cfg.rehearsal.memory_content,
                                              kinds=cfg.train.sft_act_memory_kinds, **kw)
    if "rehearse" in cfg.train.sft_roles:
        p = params
        out["rehearse"] = rehearse_examples(
            transitions, tokenizer, tasks, cfg.data.policy_max_chars,
            budgets=p.max_new_tokens_rehearse_per_tool, default_budget=p.max_new_tokens_rehearse,
            max_observation_tokens=p.max_observation_tokens, grounding=p.grounding, grounding_k=p.grounding_k,
            grounding_max_tokens=p.grounding_max_tokens, max_tokens=cfg.train.sft_max_tokens,
            max_examples=cfg.train.sft_max_rehearse_examples, error_share=cfg.train.sft_rehearse_error_share,
            seed=cfg.train.seed)
    return out


def progress(steps: int, say: Callable[[str], None], lines: int = 12) -> Callable[[str], None]:
    """A `sft.sft_warmup` log that says about `lines` of its per-step lines ("[sft] step k/N: loss …
    (…s)"): every ceil(steps / lines)-th step and the last, prefixed with "[warm_start]"."""
    every = max(1, -(-steps // lines))

    def log(line: str) -> None:
        k = int(line.split("step ", 1)[1].split("/", 1)[0])
        if k % every == 0 or k == steps:
            say(f"[warm_start] {line}")
    return log


def warm_up(cfg: RunConfig, trainer: PolicyTrainer, by_role: dict[str, list[SFTExample]],
            say: Callable[[str], None] = print) -> dict[str, list[float]]:
    """train.sft_warmup_steps SFT steps (`sft.sft_warmup`) on `by_role` (`warm_examples`): a shared
    policy on all roles' examples together, a per-role policy each adapter on its own role's examples
    (peft's active adapter is the trainable one; "act" is active again afterwards). Returns the
    per-step losses (nats per completion token) by unit: {"policy": [...]} or {"act": [...],
    "rehearse": [...]} (adapter names).

    Raises:
        EnvaceError: a role of train.sft_roles has no example within rollout.max_turns and
            train.sft_max_tokens; sft.SFTError for a non-finite loss.
    """
    from envace_core.engines.base import ROLE_ADAPTERS
    from envace_core.training.sft import sft_warmup

    for role, ex in by_role.items():
        if not ex:
            raise EnvaceError(f"train.sft_warmup_steps={cfg.train.sft_warmup_steps} with '{role}' in "
                              f"train.sft_roles but no train task has a gold {role.upper()} turn within "
                              f"rollout.max_turns={cfg.rollout.max_turns} and train.sft_max_tokens="
                              f"{cfg.train.sft_max_tokens} tokens")
    units = [(ROLE_ADAPTERS[r], ex) for r, ex in by_role.items()] if cfg.train.policy_per_role \
        else [(None, [e for ex in by_role.values() for e in ex])]
    counts = ", ".join(f"{len(ex)} {r.upper()}" for r, ex in by_role.items())
    act_repeats = effective_act_repeats(cfg.train)
    reps = f", ACT × {act_repeats} per pass" if act_repeats > 1 else ""
    losses: dict[str, list[float]] = {}
    for adapter, examples in units:
        if adapter is not None:
            trainer.model.set_adapter(adapter)  # peft: the active adapter is the trainable one
        losses[adapter or "policy"] = got = sft_warmup(
            trainer, examples, cfg.train.sft_warmup_steps, cfg.train.sft_learning_rate,
            cfg.train.sft_batch_rows, seed=cfg.train.seed, log=progress(cfg.train.sft_warmup_steps, say),
            role_repeats={"act": act_repeats} if act_repeats > 1 else None)
        say(f"[warm_start] SFT warm-up{f' of adapter {adapter!r}' if adapter else ''}: {len(got)} steps on "
            f"{len(examples)} examples ({counts}{reps}), loss {got[0]:.4f} -> {got[-1]:.4f}")
    if cfg.train.policy_per_role:
        trainer.model.set_adapter(ROLE_ADAPTERS["act"])
    return losses


def stored_warm_start(store: Any, key: str, warm_id: str) -> dict[str, Any] | None:
    """The result recorded in the warm start at store `key`, or None when nothing committed is there (no
    CHECKSUMS.json: nothing, or a write killed before its commit, which the caller's own write replaces). Its
    ``adapter_uri`` is where the adapter is in `store` now: the recorded one names where the store was when
    it was written, which a store copied or moved to another path (another machine's disk, a renamed
    bucket) no longer holds.

    Raises:
        store.StoreError: a file there no longer matches the directory's checksums (changed, missing or
            added since it was written; the message names them), or its warm_start.json is not this
            warm start's record. Nothing is retrained over it or changed: the user moves it aside.
    """
    if not (store.exists(f"{key}/{META}") and store.exists(f"{key}/{CHECKSUMS}")):
        return None  # nothing there, or a write that never committed (put_dir writes CHECKSUMS.json last)
    d = store.get_verified_dir(key)
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{store.uri(key)}/{META} cannot be read ({e}): move {store.uri(key)} aside") from e
    if not isinstance(meta, dict) or meta.get("warm_start_id") != warm_id:
        raise StoreError(f"{store.uri(key)}/{META} is not the record of warm start {warm_id}: move "
                         f"{store.uri(key)} aside (or delete it) so that it is trained again")
    return {**meta, "adapter_uri": store.uri(f"{key}/adapter")}


def warm_start(cfg: RunConfig, dataset: dict[str, Any], say: Callable[[str], None] = print) -> dict[str, Any]:
    """The warm start of `cfg` on `dataset` (module docstring): reused from the store when it holds a
    complete one for this id, else trained and written there.

    Without SFT (train.sft_warmup_steps = 0) nothing is trained or written: the start is
    train.init_adapter itself, or, without one, the fresh LoRA of train.seed (adapter_uri None).

    Returns:
        {"warm_start_id", "key" (store key; None without SFT), "adapter_uri" (the adapter to start
        from: in the store, train.init_adapter without SFT, or None for a fresh LoRA), "settings"
        (`warm_start_settings`), "base_model" (`models.base_model_lineage`), "init_adapter",
        "examples" {role: n}, "losses" {unit: per-step losses}, "steps", "seconds" (SFT wall time)},
        and with train.sft_act_final_steps "mixed_warm_start" {"warm_start_id", "adapter_uri", "seconds"}
        (the first phase; "losses" then also holds "act_final"). A reused warm start returns the record
        it was written with.

    Raises:
        EnvaceError: the dataset has no train task, or a role has no warm-up example (`warm_up`);
        trainer.AdapterLoadError for an unusable train.init_adapter; store.StoreError for storage
        failures.
    """
    from envace_core.models import base_model_lineage

    t0 = time.perf_counter()
    base = base_model_lineage(cfg.model.ref)
    warm_id = warm_start_id(cfg, dataset, base["sha256"])
    record: dict[str, Any] = {
        "warm_start_id": warm_id, "key": None, "adapter_uri": cfg.train.init_adapter,
        "settings": warm_start_settings(cfg, dataset), "base_model": base,
        "init_adapter": cfg.train.init_adapter, "examples": {}, "losses": {}, "steps": 0, "seconds": 0.0}
    if cfg.train.sft_warmup_steps <= 0:
        say(f"[warm_start] {warm_id}: no SFT warm-up (train.sft_warmup_steps=0); the run starts from "
            + (f"train.init_adapter={cfg.train.init_adapter}" if cfg.train.init_adapter else "a fresh LoRA"))
        return record
    store = open_store(cfg.store.root)
    key = WARM_START_KEY.format(warm_start_id=warm_id)
    for note in store.recover_dir(key):
        say(f"[warm_start] store recovery: {note}")
    found = stored_warm_start(store, key, warm_id)
    if found is not None:
        say(f"[warm_start] {warm_id}: reusing the warm start at {found['adapter_uri']} "
            f"(trained in {found['seconds']:.0f}s; examples {found['examples']})")
        return found
    if store.exists(key):
        say(f"[warm_start] {warm_id}: {store.uri(key)} holds a write that never finished (no CHECKSUMS.json): "
            "training the warm start again, then replacing it")
    final = effective_act_final_steps(cfg.train)
    trained = train_act_final(cfg, dataset, final, say) if final else train_warm_start(cfg, dataset, say)
    record.update(key=key, adapter_uri=store.uri(f"{key}/adapter"), examples=trained["examples"],
                  losses=trained["losses"], steps=cfg.train.sft_warmup_steps + final,
                  seconds=round(time.perf_counter() - t0, 1))
    if final:
        record["mixed_warm_start"] = trained["mixed_warm_start"]
    with tempfile.TemporaryDirectory(prefix="envace-warm-") as tmp:
        trained["trainer"].save_adapter(str(Path(tmp) / "adapter"))
        (Path(tmp) / META).write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
        store.put_dir(tmp, key)  # atomic: the key appears only complete
    say(f"[warm_start] {warm_id}: adapter -> {record['adapter_uri']} ({record['seconds']:.0f}s)")
    return record


def train_warm_start(cfg: RunConfig, dataset: dict[str, Any], say: Callable[[str], None] = print) -> dict[str, Any]:
    """Load the policy (`policy.load_policy`, a `PolicyTrainer` with the LoRA of train.*), copy
    train.init_adapter into it, then `warm_up` on `warm_examples` of the dataset's train tasks.
    Returns {"trainer", "examples" {role: n}, "losses"}; raises as `warm_start`."""
    from envace_core.stages.dataset import load_dataset
    from envace_core.training.loop import grounded_params, load_init_adapter, real_train_transitions
    from envace_core.training.policy import load_policy, rollout_params
    from envace_core.training.trainer import PolicyTrainer

    tasks = load_dataset(dataset, "train")
    if not tasks:
        raise EnvaceError(f"dataset {dataset['version']} has no train tasks: re-run curate")
    model, tok, _ = load_policy(cfg)
    trainer = PolicyTrainer(model, tok, cfg.train, compute_dtype=cfg.model.compute_dtype)
    if cfg.train.init_adapter:
        load_init_adapter(trainer, cfg.train.init_adapter)
        say(f"[warm_start] starting from the LoRA adapter {cfg.train.init_adapter}")
    params = rollout_params(cfg)
    needs = "rehearse" in cfg.train.sft_roles or cfg.rollout.grounding_k > 0
    transitions = real_train_transitions(cfg, tasks) if needs else []
    params = grounded_params(cfg, params, transitions)
    by_role = warm_examples(cfg, tasks, trainer.tokenizer, params, transitions)
    losses = warm_up(cfg, trainer, by_role, say)
    return {"trainer": trainer, "examples": {r: len(ex) for r, ex in by_role.items()}, "losses": losses}


def mixed_phase_config(cfg: RunConfig) -> RunConfig:
    """`cfg` with train.sft_act_final_steps = 0: the config of a two-phase warm start's first, mixed phase."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"sft_act_final_steps": 0})})


def train_act_final(cfg: RunConfig, dataset: dict[str, Any], steps: int,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """A two-phase warm start: the mixed warm start of `mixed_phase_config` (`warm_start`: reused from the
    store, or trained and stored there), then `steps` ACT-only SFT steps (`sft.sft_warmup`, a fresh AdamW
    at train.sft_learning_rate, train.sft_batch_rows rows, seed train.seed) from its adapter, on the ACT
    examples of `warm_examples`. Returns {"trainer", "examples" {role: n} (the mixed phase's),
    "losses" (the mixed phase's, plus "act_final"), "mixed_warm_start" {"warm_start_id", "adapter_uri",
    "seconds"}}; raises as `warm_start`."""
    from envace_core.stages.dataset import load_dataset
    from envace_core.training.loop import load_init_adapter
    from envace_core.training.policy import load_policy, rollout_params
    from envace_core.training.sft import sft_warmup
    from envace_core.training.trainer import PolicyTrainer

    mixed = warm_start(mixed_phase_config(cfg), dataset, say)
    model, tok, _ = load_policy(cfg)
    trainer = PolicyTrainer(model, tok, cfg.train, compute_dtype=cfg.model.compute_dtype)
    load_init_adapter(trainer, mixed["adapter_uri"], f"the adapter of mixed warm start {mixed['warm_start_id']}")
    act_only = cfg.model_copy(update={"train": cfg.train.model_copy(update={"sft_roles": ["act"]})})
    examples = warm_examples(act_only, load_dataset(dataset, "train"), tok, rollout_params(cfg), [])["act"]
    if not examples:
        raise EnvaceError(f"train.sft_act_final_steps={steps} but no train task has a gold ACT turn within "
                          f"rollout.max_turns={cfg.rollout.max_turns} and train.sft_max_tokens="
                          f"{cfg.train.sft_max_tokens} tokens")
    say(f"[warm_start] then {steps} ACT-only steps from mixed warm start {mixed['warm_start_id']}")
    losses = sft_warmup(trainer, examples, steps, cfg.train.sft_learning_rate, cfg.train.sft_batch_rows,
                        seed=cfg.train.seed, log=progress(steps, say))
    say(f"[warm_start] ACT-only phase: {len(losses)} steps on {len(examples)} ACT examples, loss "
        f"{losses[0]:.4f} -> {losses[-1]:.4f}")
    return {"trainer": trainer, "examples": mixed["examples"], "losses": {**mixed["losses"], "act_final": losses},
            "mixed_warm_start": {k: mixed[k] for k in ("warm_start_id", "adapter_uri", "seconds")}}
