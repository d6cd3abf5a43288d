"""The engine interface every backend (transformers, vLLM) implements.

Token ids in, token ids plus behaviour log-probs out, so that training uses exactly what was sampled
(no re-tokenisation drift).
"""

from __future__ import annotations

from collections.abc import Callable

import functools
import operator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

# CPU flags of native bfloat16 matmul (Intel/AMD AVX-512 BF16, Intel AMX). Without them torch emulates
# bf16 on the CPU: measured on a 2-core AVX2-only EPYC, SmolLM2-135M's bf16 forward+backward of 256
# tokens did not finish in 130 s, against 13 s in float32; with avx512_bf16 bf16 matmul is 4.3x float32.
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
COMPUTE_DTYPES = ("auto", "bfloat16", "float32")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU's flags (Linux `cpuinfo`) include one of `NATIVE_BF16_CPU_FLAGS`; False when
    they don't or the file cannot be read (other systems)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[-1].split()}
    return any(f in flags for f in NATIVE_BF16_CPU_FLAGS)


def resolve_compute_dtype(name: str, device_type: str) -> str:
    """The autocast dtype for `name` ("auto", "bfloat16" or "float32") on a device of `device_type`
    ("cpu", "cuda", ...): "auto" is "bfloat16" on CUDA and on CPUs with native bf16
    (`cpu_has_native_bf16`), else "float32". Raises ValueError for another `name`."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, got {name!r}")
    if name != "auto":
        return name
    return "bfloat16" if device_type == "cuda" or (device_type == "cpu" and cpu_has_native_bf16()) else "float32"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one `generate` call.

    temperature: 0 means greedy; log-probs are then those of logits at temperature 1.
    n: samples per prompt (a GRPO group shares one prompt).
    stop_token_ids: generation of a sample ends after emitting any of these (it is kept in the ids).
    role: the policy role generating ("act", "rehearse", "user", "self_eval") or None. An engine
        over a per-role policy (two LoRA adapters, `ROLE_ADAPTERS`) generates with that role's adapter.
    ignore_eos: True ends samples only at max_new_tokens (no eos, no stop tokens), as vLLM's option of
        the same name; throughput benchmarks use it so every sample decodes the same number of tokens.
    stop_when: an optional predicate on a sample's generated ids so far; the transformers engine
        ends the sample (finish_reason "stop") as soon as it returns True, checked every
        `stop_check_every` tokens (not with ignore_eos). Only for predicates whose verdict no
        continuation can change (e.g. `roles.json_prefix.NotJsonStop`: the output can no longer
        parse), so stopping saves decoding and changes no outcome; the vLLM engine decodes on.
    constraints: None, or one constraint (or None) per prompt: an object with
        ``allows(token_ids, ends) -> bool`` (`OutputConstraint`, e.g. `roles.constrained.ActConstraint`).
        The transformers engine draws only tokens it allows (structured outputs, as vLLM's
        ``StructuredOutputsParams``): a drawn token it refuses is taken out of that row's distribution
        and the row draws again (`engines.constrained_sampling`); `Completion.logprobs` stay the
        unconstrained log-probs of the tokens drawn (vLLM's ``raw_logprobs``), so the training forward
        recomputes the same quantity. A row with no allowed token ends (finish_reason "stop") without
        it (finish_reason "stop" with no stop token last). With ignore_eos no token is a stop, so the
        constraint is never asked whether a sample may end. The vLLM engine samples unconstrained (it
        logs a warning once).
    prompt_seeds: None, or one ``(seed, index)`` pair per prompt: prompt i is sampled exactly as prompt
        ``index`` of a call seeded ``seed`` would be (``seed`` is then ignored). `engines.merging` uses it
        to run several callers' calls as one batch whose every prompt keeps the randomness of its own call.
    prompt_max_new_tokens: None, or one token budget (an int >= 0) per prompt: prompt i's samples end after
        that many tokens ("length") instead of ``max_new_tokens``, which is then ignored (vLLM's per-request
        ``max_tokens``). One call then decodes rows of different budgets in one batch, e.g. REHEARSE calls of
        tools whose results differ in length, instead of one call per budget, each decoding until its longest
        row ends. A row's samples are those of a call with its budget alone (each row draws from its own
        generator; up to float rounding of a different batch shape).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    role: str | None = None
    ignore_eos: bool = False
    stop_when: Callable[[list[int]], bool] | None = field(default=None, compare=False)
    stop_check_every: int = 8
    prompt_seeds: tuple[tuple[int, int], ...] | None = None
    constraints: tuple[OutputConstraint | None, ...] | None = field(default=None, compare=False)
    prompt_max_new_tokens: tuple[int, ...] | None = None

    def __post_init__(self):  # a list of budgets is taken as the tuple it stands for (hashable, comparable)
        if isinstance(self.prompt_max_new_tokens, list):
            object.__setattr__(self, "prompt_max_new_tokens", tuple(self.prompt_max_new_tokens))


@runtime_checkable
class OutputConstraint(Protocol):
    """A decoding constraint (`SamplingParams.constraints`)."""

    def allows(self, token_ids: list[int], ends: bool) -> bool:
        """May a sample's generated ids be `token_ids` (the drawn candidate last); with `ends` (the
        candidate is a stop token), may the sample end there?"""
        ...


def check_constraints(params: SamplingParams, n_prompts: int) -> None:
    """Raise ValueError unless ``params.constraints`` is None or holds one entry (a constraint with an
    ``allows`` method, or None) per prompt."""
    c = params.constraints
    if c is None:
        return
    if not isinstance(c, (tuple, list)):
        raise ValueError(f"SamplingParams.constraints must be a tuple (one constraint or None per prompt), "
                         f"got {type(c).__name__}")
    if len(c) != n_prompts:
        raise ValueError(f"SamplingParams.constraints holds {len(c)} entries for {n_prompts} prompts: "
                         "give one (a constraint or None) per prompt")
    bad = [x for x in c if x is not None and (isinstance(x, type) or not callable(getattr(x, "allows", None)))]
    if bad:
        what = f"the class {bad[0].__name__} (pass an instance)" if isinstance(bad[0], type) else \
            f"{type(bad[0]).__name__} has no allows(token_ids, ends) method"
        raise ValueError(f"SamplingParams.constraints: {what}")


def check_prompt_seeds(params: SamplingParams, n_prompts: int) -> None:
    """Raise ValueError unless ``params.prompt_seeds`` is None or holds one pair per prompt."""
    if params.prompt_seeds is not None and len(params.prompt_seeds) != n_prompts:
        raise ValueError(f"SamplingParams.prompt_seeds holds {len(params.prompt_seeds)} pairs for "
                         f"{n_prompts} prompts: give one (seed, index) per prompt")


def _token_budget(x) -> int | None:
    """`x` as a token budget (an int >= 0; numpy ints too, bools not), or None when it is not one."""
    try:
        v = None if isinstance(x, bool) else operator.index(x)
    except TypeError:
        return None
    return v if v is not None and v >= 0 else None


def prompt_budgets(params: SamplingParams, n_prompts: int) -> list[int]:
    """Each prompt's token budget: ``params.prompt_max_new_tokens`` when given, else ``max_new_tokens`` for
    every prompt.

    Raises:
        ValueError: ``max_new_tokens`` is not an int >= 0 (checked also when per-prompt budgets replace it: a
            bad value there is a caller's bug), or ``prompt_max_new_tokens`` is not a tuple or list of one
            int >= 0 per prompt (bools and floats are not budgets; the message names the prompt).
    """
    if _token_budget(params.max_new_tokens) is None:
        raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 0, got {params.max_new_tokens!r}")
    b = params.prompt_max_new_tokens
    if b is None:
        return [_token_budget(params.max_new_tokens)] * n_prompts  # type: ignore[list-item]
    if not isinstance(b, (tuple, list)):
        raise ValueError(f"SamplingParams.prompt_max_new_tokens must be a tuple (one budget per prompt), "
                         f"got {type(b).__name__}")
    if len(b) != n_prompts:
        raise ValueError(f"SamplingParams.prompt_max_new_tokens holds {len(b)} budget(s) for {n_prompts} "
                         "prompt(s): give one per prompt")
    out = []
    for i, x in enumerate(b):
        v = _token_budget(x)
        if v is None:
            raise ValueError(f"SamplingParams.prompt_max_new_tokens[{i}]: {x!r} is not a token budget "
                             "(an int >= 0)")
        out.append(v)
    return out


def with_prompt_budgets(params: SamplingParams, budgets) -> SamplingParams:
    """`params` for prompts whose token budgets are `budgets` (one int >= 0 per prompt): ``max_new_tokens`` the
    largest, and ``prompt_max_new_tokens`` only where they differ (equal budgets stay one ``max_new_tokens``,
    which every engine reads)."""
    budgets = tuple(budgets)
    return replace(params, max_new_tokens=max(budgets, default=0),
                   prompt_max_new_tokens=budgets if len(set(budgets)) > 1 else None)


# Per-role policy ablation (METHOD.md §1, "noshare"): which named LoRA adapter plays each role. The
# agent side (ACT, its self-evaluation, untagged calls) uses "act"; the simulators of the world
# (REHEARSE, USER-REHEARSE) use "rehearse".
ROLE_ADAPTERS: dict[str | None, str] = {
    None: "act", "act": "act", "self_eval": "act", "rehearse": "rehearse", "user": "rehearse"}


def role_adapter(model, role: str | None) -> str | None:
    """The adapter name `role` generates with on `model`, or None when `model` is not a per-role
    policy (a peft model holding both adapters named in `ROLE_ADAPTERS`)."""
    names = set(getattr(model, "peft_config", None) or ())
    if not set(ROLE_ADAPTERS.values()) <= names:
        return None
    return ROLE_ADAPTERS.get(getattr(role, "value", role), "act")  # a Role member or its value


@dataclass
class Completion:
    """One sample. `token_ids` has length C; `logprobs[i]` = log p(token_ids[i] | prefix) under the
    sampling distribution (logits / temperature, or temperature 1 when greedy), natural log."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was emitted, or, under a constraint, no token was allowed) | "length" (max_new_tokens reached)


@runtime_checkable
class Engine(Protocol):
    """A text generator over one policy. `tokenizer` is the policy's HF tokenizer."""

    tokenizer: object

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample `params.n` completions for each prompt.

        Args:
            prompts: B prompts, each a list of token ids (no padding).
        Returns:
            B lists of `params.n` completions, in prompt order.
        """
        ...
