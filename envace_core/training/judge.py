"""The `judge` reward (METHOD.md §2): an LLM judge grades a trajectory against the task's checklist.

The reference (EnvACE) rewards trajectories with an external LLM judge over checklists; we keep that
scheme as a plug-in next to the verifiable `replay` reward. The judge is served by our own engine
type (`engines.hf.HFEngine`), by default on the policy's base model (the policy's own weights with its
LoRA adapter switched off, so no second copy is loaded), or on any model ref ``reward.judge_model``.

Checklist (`checklist`), from the task's tau2 ``evaluation_criteria`` (never shown to a policy role):
  - ACTION: each assistant-side gold action, "The agent called <name> with arguments <args>" (only
    the action's ``compare_args`` when tau2 gives them, as tau2 compares only those);
  - COMMUNICATE: each ``communicate_info`` string, "The agent told the user: <info>";
  - NL_ASSERTION: each ``nl_assertions`` sentence, as written.

Verdict format (strict, `parse_verdict`): exactly one JSON object ``{"met": [b_1, ..., b_n]}`` with
one boolean per checklist item, in order (whitespace and one ``` fence around it are accepted). Any
other output is an `InvalidVerdict`, and the trajectory's reward is then ``None`` (masked in
training), never 0.

Reward: "mean" (default) = fraction of items met; "all" = 1.0 iff every item is met (tau2's
all-or-nothing rule). ``sub_rewards[kind]`` = fraction met per kind.
"""

from __future__ import annotations

import json
import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

from envace_core import EnvaceError
from envace_core.engines.base import Completion, Engine, SamplingParams
from envace_core.envs.base import RewardResult
from envace_core.roles.bounds import MAX_OBSERVATION_TOKENS, PromptTooLong, bound_text, check_prompt, prompt_limit
from envace_core.roles.chat import chat_ids
from envace_core.roles.errors import EmptyOutput, ParseError, format_error
from envace_core.roles.strict_json import strict_json
from envace_core.types import Role, Task, Trajectory

if TYPE_CHECKING:
    from envace_core.config import RunConfig



class InvalidVerdict(ParseError):
    """A judge output that is not exactly ``{"met": [<one boolean per checklist item>]}``."""


@dataclass(frozen=True)
class ChecklistItem:
    kind: Literal["ACTION", "COMMUNICATE", "NL_ASSERTION"]  # tau2's reward-breakdown names
    text: str


def checklist(task: Task) -> list[ChecklistItem]:
    """The task's checklist (module docstring), in the order ACTION, COMMUNICATE, NL_ASSERTION."""
    crit = (task.source or {}).get("evaluation_criteria") or {}
    items: list[ChecklistItem] = []
    for a in crit.get("actions") or []:
        if a.get("requestor", "assistant") != "assistant":
            continue  # user-side actions (telecom) are not the agent's to take
        args = a.get("arguments") or {}
        keys = a.get("compare_args")
        if keys is not None:
            args = {k: v for k, v in args.items() if k in keys}
        items.append(ChecklistItem("ACTION", f"The agent called {a['name']} with arguments "
                                             f"{json.dumps(args, ensure_ascii=False, sort_keys=True)}."))
    items += [ChecklistItem("COMMUNICATE", f"The agent told the user: {info}")
              for info in crit.get("communicate_info") or []]
    items += [ChecklistItem("NL_ASSERTION", str(x)) for x in crit.get("nl_assertions") or []]
    return items


def transcript(task: Task, trajectory: Trajectory, tokenizer=None,
               max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS) -> str:
    """The conversation as text lines: the user's first message, then per step the agent's call and
    the observation the trajectory continued with (imagined in a rehearsal) or the agent's message,
    each message followed by the imagined user's reply when USER-REHEARSE produced one (the k-th
    USER row answers the k-th agent message, as `rollout.unroll` orders them). With `tokenizer`,
    each observation is cut to `max_observation_tokens` tokens with the marker of
    `roles.bounds.bound_text` (the cut every role's prompt uses)."""
    users = [g for g in trajectory.generations if g.role == Role.USER]
    lines = [f"user: {task.first_user_message.strip()}"]
    k = 0
    for s in trajectory.steps:
        if s.action is not None:
            call = json.dumps({"name": s.action.name, "arguments": s.action.arguments}, ensure_ascii=False)
            lines.append(f"agent called: {call}")
            if s.observation is not None:
                obs = s.observation.content if tokenizer is None else \
                    bound_text(s.observation.content, tokenizer, max_observation_tokens)
                lines.append(f"tool returned: {obs.strip()}")
            continue
        lines.append(f"agent: {s.message.strip()}")
        if k < len(users):
            g = users[k]
            k += 1
            lines.append(f"user: {g.text.strip()}" if g.parse_error is None else "user: (no valid reply)")
    return "\n".join(lines)


_SYSTEM = (
    "You are a strict grader of a conversation between a customer service agent in the {domain} domain "
    "and a user. For each numbered checklist item decide whether the conversation satisfies it; an item "
    "not clearly satisfied is not met. Reply with ONLY a JSON object, nothing before or after it:\n"
    '{{"met": [<true or false for item 1>, ..., <for item {n}>]}}\nwith exactly {n} booleans, in order.'
)


def judge_messages(task: Task, trajectory: Trajectory, items: list[ChecklistItem], tokenizer=None,
                   max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS) -> list[dict]:
    """The judge's chat messages: the grading rule and format (system), the `transcript` (tool results
    cut as there when `tokenizer` is given) and the numbered checklist (user)."""
    numbered = "\n".join(f"{i}. {it.text}" for i, it in enumerate(items, 1))
    conversation = transcript(task, trajectory, tokenizer, max_observation_tokens)
    user = (f"# Conversation\n{conversation}\n\n# Checklist\n{numbered}\n\n"
            "Reply with the JSON object only.")
    return [{"role": "system", "content": _SYSTEM.format(domain=task.domain, n=len(items))},
            {"role": "user", "content": user}]


_FENCE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n(.*?)\n?```\Z", re.DOTALL)


def parse_verdict(text: str, n_items: int) -> list[bool]:
    """Parse a judge output strictly (module docstring). Returns the n_items booleans.

    Raises `EmptyOutput` (empty/whitespace) or `InvalidVerdict` (not one JSON value (`strict_json`:
    NaN/Infinity and nesting deeper than the interpreter allows included), keys other than "met",
    "met" not a list of exactly `n_items` JSON booleans).
    """
    if not text or not text.strip():
        raise EmptyOutput("empty verdict", text or "")
    body = text.strip()
    fence = _FENCE.match(body)
    if fence:
        body = fence.group(1).strip()
    try:
        obj = strict_json(body)
    except ValueError as e:  # strict_json: also NaN/Infinity and nesting too deep for the interpreter
        raise InvalidVerdict(f"not a single JSON object: {e}", text) from None
    if not isinstance(obj, dict) or set(obj) != {"met"}:
        raise InvalidVerdict('the verdict must be exactly {"met": [...]}', text)
    met = obj["met"]
    if not isinstance(met, list) or len(met) != n_items or not all(isinstance(b, bool) for b in met):
        raise InvalidVerdict(f'"met" must be a list of exactly {n_items} booleans, got {json.dumps(met)[:80]}',
                             text)
    return met


class _AdapterOff:
    """An engine view that generates with the LoRA adapter of `engine.model` disabled: the base model,
    from the same weights (peft's ``disable_adapter`` context; a plain model is used as is)."""

    def __init__(self, engine: Engine):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.model = getattr(engine, "model", None)  # the context length reads from it (`roles.bounds`)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        model = getattr(self.engine, "model", None)
        ctx = model.disable_adapter() if hasattr(model, "disable_adapter") else nullcontext()
        with ctx:
            return self.engine.generate(prompts, params)


class Judge:
    """Grades trajectories against their task's checklist with `engine` (greedy decoding).

    Args:
        engine: an `Engine` serving the judge model.
        max_new_tokens: verdict budget (tokens).
        aggregate: "mean" (fraction of items met) or "all" (1.0 iff all met).
        max_observation_tokens: each tool result in the transcript is cut to this many tokens
            (`roles.bounds.bound_text`; rollout.max_observation_tokens).
        max_prompt_tokens: prompt cap besides the engine's context (`roles.bounds.prompt_limit`).

    `score(task, trajectory)` -> RewardResult, or None when the task has no checklist, the judge's
    prompt does not fit (`PromptTooLong`) or the verdict does not parse (then ``trajectory.reward is
    None``: masked, and ``reward_info["error"]`` says why).
    """

    def __init__(self, engine: Engine, max_new_tokens: int = 64, aggregate: str = "mean",
                 max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS, max_prompt_tokens: int | None = None):
        if aggregate not in ("mean", "all"):
            raise EnvaceError(f"reward.judge_aggregate must be 'mean' or 'all', got {aggregate!r}")
        self.engine, self.max_new_tokens, self.aggregate = engine, max_new_tokens, aggregate
        self.max_observation_tokens, self.max_prompt_tokens = max_observation_tokens, max_prompt_tokens

    def score(self, task: Task, trajectory: Trajectory) -> Optional[RewardResult]:
        items = checklist(task)
        if not items:
            return self._fail(trajectory, "the task has no checklist (no gold action, communicate_info "
                                          "or nl_assertion) to judge against")
        tok = self.engine.tokenizer
        prompt = chat_ids(tok, judge_messages(task, trajectory, items, tok, self.max_observation_tokens))
        try:
            check_prompt("judge", prompt, prompt_limit(self.engine, self.max_new_tokens, self.max_prompt_tokens))
        except PromptTooLong as e:
            return self._fail(trajectory, f"{type(e).__name__}: {e}")
        out = self.engine.generate([prompt], SamplingParams(max_new_tokens=self.max_new_tokens,
                                                            temperature=0.0))[0][0]
        text = tok.decode(out.token_ids, skip_special_tokens=True)
        try:
            met = parse_verdict(text, len(items))
        except ParseError as e:
            return self._fail(trajectory, format_error(e), judge_text=text)
        reward = sum(met) / len(met) if self.aggregate == "mean" else float(all(met))
        sub: dict[str, float] = {}
        for kind in ("ACTION", "COMMUNICATE", "NL_ASSERTION"):
            ks = [m for it, m in zip(items, met) if it.kind == kind]
            if ks:
                sub[kind] = sum(ks) / len(ks)
        info: dict[str, Any] = {"reward_fn": "judge", "aggregate": self.aggregate, "judge_text": text,
                                "checklist": [{"kind": it.kind, "text": it.text, "met": m}
                                              for it, m in zip(items, met)],
                                "termination": trajectory.termination}
        res = RewardResult(reward=reward, sub_rewards=sub, info=info)
        trajectory.reward, trajectory.sub_rewards, trajectory.reward_info = reward, dict(sub), dict(info)
        return res

    @staticmethod
    def _fail(trajectory: Trajectory, error: str, **info: Any) -> None:
        trajectory.reward = None  # masked in training, never scored 0 (METHOD.md §3)
        trajectory.sub_rewards = {}
        trajectory.reward_info = {"error": error, "reward_fn": "judge", **info}


_ENGINES: dict[tuple[str, str], Engine] = {}


def build_judge(cfg: RunConfig, policy_engine: Optional[Engine] = None) -> Judge:
    """The `Judge` that ``cfg.reward`` configures.

    Model: ``cfg.reward.judge_model``; None means the policy's base model (``cfg.model.ref``), served
    from `policy_engine`'s own weights with the adapter disabled when `policy_engine` is given (no
    second copy), else loaded. A loaded judge model (`models.resolve_model` / `load_model`, an
    `HFEngine` in ``cfg.model.compute_dtype``) is cached per (ref, dtype) for the process.
    """
    r = cfg.reward
    # (an engine without the live model, e.g. vLLM's copy of the merged policy, cannot switch the adapter off)
    if r.judge_model is None and policy_engine is not None and hasattr(policy_engine, "model"):
        engine: Engine = _AdapterOff(policy_engine)
    else:
        ref = r.judge_model or cfg.model.ref
        key = (ref, cfg.model.compute_dtype)
        if key not in _ENGINES:
            from envace_core.engines.hf import HFEngine
            from envace_core.models import load_model, load_tokenizer, resolve_model

            path = resolve_model(ref, "reward.judge_model" if r.judge_model else "model.ref")
            model = load_model(path).eval()
            _ENGINES[key] = HFEngine(model, load_tokenizer(path), compute_dtype=cfg.model.compute_dtype)
        engine = _ENGINES[key]
    return Judge(engine, r.judge_max_new_tokens, r.judge_aggregate, cfg.rollout.max_observation_tokens,
                 cfg.rollout.max_prompt_tokens)
