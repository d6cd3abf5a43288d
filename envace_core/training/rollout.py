"""Rollouts: self-unfolded rehearsal trajectories (training, Private Rehearsal) and real ones.

Self-unfolded (METHOD.md §1): ACT emits a_t from h_t; REHEARSE, the same policy, imagines ô_t from
(h_t, a_t); h_{t+1} = h_t ⊕ (a_t, ô_t). No environment is reachable from here: the functions take a
`TaskContext` (tools, policy text, first user message) and an engine, never an environment handle.
A group's G trajectories advance in lockstep so each turn is one batched engine call per role; the
first ACT turn of a group is one prompt sampled G ways (its prefix is computed once).

USER-REHEARSE (METHOD.md §1, multi-agent rehearsal): given the user's instructions (tau2 tasks), a
text reply of ACT to the user does not end the trajectory; the same policy, prompted as tau2's user
simulator, imagines the user's next message (role "user"), which is appended to the history; the user
ends the conversation with a tau2 stop token ("user_stop").

Standard-GRPO ablation (METHOD.md §3): `real_rollouts` runs a group of ACT-only trajectories, each
against its own private environment copy. `training_group` is what the training loop calls: rollouts
from the configured source, then the configured reward (`rewards.score_trajectory`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

from envace_core.engines.base import Completion, Engine, SamplingParams, with_prompt_budgets
from envace_core.envs.base import ToolEnvironment
from envace_core.roles.act import act_prompt_ids, parse_act
from envace_core.roles.bounds import MAX_OBSERVATION_TOKENS, PromptTooLong, check_prompt, prompt_limit
from envace_core.roles.constrained import ActConstraint, RehearseConstraint
from envace_core.roles.errors import ParseError, UnknownTool, format_error
from envace_core.roles.grounding import GroundingIndex
from envace_core.roles.json_prefix import NotJsonStop
from envace_core.roles.rehearse import parse_rehearse, rehearse_prompt_ids
from envace_core.roles.user import parse_user, user_instructions, user_prompt_ids
from envace_core.training.rewards import reward_fn_from_config, score_trajectory
from envace_core.types import (
    Generation,
    Message,
    Observation,
    Role,
    Step,
    Task,
    TaskContext,
    ToolCall,
    Trajectory,
)

if TYPE_CHECKING:
    from envace_core.config import RunConfig



# Terminations whose trajectory cannot be judged at all: its reward is None, so its rows are masked
# (METHOD.md §3), never scored 0 or penalised (`mask_unjudgeable`).
PROMPT_TOO_LONG = "prompt_too_long"
MASKED_TERMINATIONS = (PROMPT_TOO_LONG,)
# `unroll`'s `stop` ended it (Private Rehearsal: a rehearsal its verifier had already rejected)
STOPPED = "stopped"


@dataclass(frozen=True)
class RolloutParams:
    """Rollout settings (``cfg.rollout`` / ``cfg.eval``; see `config.RolloutConfig` for each field).

    max_observation_tokens: each tool result in a prompt is cut to this many tokens with a marker
        (`roles.bounds.bound_text`); None = uncut.
    max_prompt_tokens: the most prompt tokens of any role's call; None = only the engine's context
        minus the role's max_new_tokens (`roles.bounds.prompt_limit`). A longer prompt ends its
        trajectory as "prompt_too_long".
    lenient: `parse_act(..., lenient=...)`: take calls in other model families' formats (off: they
        are `ForeignToolCallFormat` parse errors).
    max_new_tokens_rehearse_per_tool: REHEARSE budget per tool name (`rehearse_budget`).
    schema_errors: `parse_act(..., schema_errors=...)`: a well-formed call of an unknown tool or with
        arguments that fail the tool's schema is answered with an error observation and the
        trajectory goes on, as tau2-bench's environment answers it (``Environment.get_response``:
        ``"Error: Tool 'x' not found."``); off: it is a parse error ending the trajectory. In an
        imagined trajectory the answer is `schema_error_observation`, not a REHEARSE turn.
    grounding, grounding_k, grounding_max_tokens: REHEARSE prompts hold up to k real examples of the
        same tool from other tasks, under the token budget (`roles.grounding.GroundingIndex`).
    constrained: ACT and REHEARSE draw only tokens their format allows (`roles.constrained`,
        `SamplingParams.constraints`): a format error is then left only to calls in another family's
        format and to outputs cut by their token budget.
    """

    max_turns: int
    max_new_tokens_act: int
    max_new_tokens_rehearse: int
    temperature: float
    top_p: float = 1.0
    strict: bool = True
    max_new_tokens_user: Optional[int] = None  # USER-REHEARSE turns; None = max_new_tokens_act
    max_observation_tokens: Optional[int] = MAX_OBSERVATION_TOKENS
    max_prompt_tokens: Optional[int] = None
    lenient: bool = False
    schema_errors: bool = False
    max_new_tokens_rehearse_per_tool: Mapping[str, int] = field(default_factory=dict)
    grounding: Optional[GroundingIndex] = None
    grounding_k: int = 0
    grounding_max_tokens: int = 512
    constrained: bool = False

    def rehearse_budget(self, tool: str) -> int:
        """REHEARSE's token budget for a call of `tool`: its per-tool budget, else max_new_tokens_rehearse."""
        return self.max_new_tokens_rehearse_per_tool.get(tool, self.max_new_tokens_rehearse)

    def grounding_examples(self, task_id: str, call: ToolCall, tokenizer) -> list[tuple[ToolCall, Observation]]:
        """The grounding examples of REHEARSE's prompt for `call` of task `task_id`
        (`roles.grounding.GroundingIndex.examples`, other tasks only, budget counted by `tokenizer`);
        [] without an index or with k = 0."""
        if self.grounding is None or self.grounding_k <= 0:
            return []
        return self.grounding.examples(task_id, call, self.grounding_k, self.grounding_max_tokens, tokenizer)


def schema_error_observation(call: ToolCall, error: ParseError) -> Observation:
    """The observation answering a call that failed the tool list or schema (`RolloutParams.schema_errors`):
    the canonical error object ``{"error": <message>}`` in compact JSON, the message tau2's own for an
    unknown tool (``Tool '<name>' not found.``, tau2 ``ToolKitBase.use_tool``), else the schema error's."""
    msg = f"Tool '{call.name}' not found." if isinstance(error, UnknownTool) else str(error)
    return Observation(content=json.dumps({"error": msg}, ensure_ascii=False, separators=(",", ":")), error=True)


def make_generation(role: Role, prompt: list[int], c: Completion, tokenizer, temperature: float) -> Generation:
    return Generation(role=role, prompt_ids=list(prompt), completion_ids=list(c.token_ids),
                      logprobs=list(c.logprobs), temperature=temperature if temperature > 0 else 1.0,
                      text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                      finish_reason=c.finish_reason)


class SeedStream:
    """A deterministic stream of per-call seeds from one base seed (same seed → same rollouts)."""

    def __init__(self, seed: Optional[int]):
        self._it = itertools.count(seed) if seed is not None else None

    def next(self) -> Optional[int]:
        return next(self._it) if self._it is not None else None


def end_prompt_too_long(traj: Trajectory, err: PromptTooLong) -> None:
    """End `traj` as "prompt_too_long" (`MASKED_TERMINATIONS`), the sizes in ``reward_info``."""
    traj.termination = PROMPT_TOO_LONG
    traj.reward_info["prompt_too_long"] = {"role": err.role, "tokens": err.n_tokens, "limit": err.limit}


def fitting_prompts(engine: Engine, role: Role, trajs: list[Trajectory], idx: list[int], build: Callable,
                    max_new_tokens: int, p: RolloutParams) -> tuple[list[int], list[list[int]]]:
    """(the indices of `idx` whose prompt ``build(i)`` fits `roles.bounds.prompt_limit`, their prompts);
    the trajectories of the others end as "prompt_too_long" (never an exception out of the rollout)."""
    limit = prompt_limit(engine, max_new_tokens, p.max_prompt_tokens)
    keep, prompts = [], []
    for i in idx:
        try:
            prompts.append(check_prompt(role.value, build(i), limit))
            keep.append(i)
        except PromptTooLong as e:
            end_prompt_too_long(trajs[i], e)
    return keep, prompts


def act_turn(engine: Engine, ctx: TaskContext, trajs: list[Trajectory], histories: list[list[Message]],
              p: RolloutParams, seeds: SeedStream, memory: Optional[str], first: bool) -> list[int]:
    """One batched ACT call for the active trajectories; returns the indices that called a tool.

    A trajectory whose ACT prompt does not fit (`fitting_prompts`) ends as "prompt_too_long". A call
    answered by its schema error (`RolloutParams.schema_errors`) is returned too, its step already
    holding `schema_error_observation` (the real environment answers it itself).
    """
    tok = engine.tokenizer
    sp = SamplingParams(max_new_tokens=p.max_new_tokens_act, temperature=p.temperature, top_p=p.top_p,
                        seed=seeds.next(), role=Role.ACT.value)
    act_format = ActConstraint(tok, [t.name for t in ctx.tools]) if p.constrained and ctx.tools else None
    active = [i for i, t in enumerate(trajs) if not t.termination]

    def build(i: int) -> list[int]:
        return act_prompt_ids(tok, ctx, histories[i], memory, p.max_observation_tokens)

    if first and len(active) > 1:  # identical prompts: one prompt, n samples, prefix computed once
        fit, prompts = fitting_prompts(engine, Role.ACT, trajs, active[:1], build, p.max_new_tokens_act, p)
        if not fit:
            for i in active[1:]:
                trajs[i].termination, trajs[i].reward_info = trajs[active[0]].termination, \
                    dict(trajs[active[0]].reward_info)
            return []
        outs = engine.generate(prompts, replace(sp, n=len(active), constraints=act_format and (act_format,)))[0]
        prompts = prompts * len(active)
    else:
        active, prompts = fitting_prompts(engine, Role.ACT, trajs, active, build, p.max_new_tokens_act, p)
        sp = replace(sp, constraints=act_format and (act_format,) * len(prompts))
        outs = [o[0] for o in engine.generate(prompts, sp)] if prompts else []
    calling = []
    for i, prompt, c in zip(active, prompts, outs):
        gen = make_generation(Role.ACT, prompt, c, tok, p.temperature)
        trajs[i].generations.append(gen)
        try:
            out = parse_act(gen.text, ctx.tools, strict=p.strict, lenient=p.lenient, schema_errors=p.schema_errors)
        except ParseError as e:
            gen.parse_error = format_error(e)
            trajs[i].termination = "parse_error"
            continue
        if out.tool_call is None:
            trajs[i].steps.append(Step(message=out.message))
            histories[i].append(Message(role="assistant", content=out.message))
            trajs[i].termination = "agent_message"
        else:
            out.tool_call.id = f"call_{len(trajs[i].steps)}"
            step = Step(action=out.tool_call)
            if out.schema_error is not None:
                gen.schema_error = step.schema_error = format_error(out.schema_error)
                step.observation = schema_error_observation(out.tool_call, out.schema_error)
            trajs[i].steps.append(step)
            histories[i].append(Message(role="assistant", tool_call=out.tool_call))
            calling.append(i)
    return calling


def _rehearse_turn(engine: Engine, ctx: TaskContext, trajs: list[Trajectory],
                   histories: list[list[Message]], idx: list[int], p: RolloutParams, seeds: SeedStream) -> None:
    """One batched REHEARSE call: the policy imagines the tool response of each pending call; a call
    that failed the tool list or schema keeps its `schema_error_observation` (no REHEARSE row)."""
    for i in [i for i in idx if trajs[i].steps[-1].schema_error]:
        histories[i].append(Message(role="tool", content=trajs[i].steps[-1].observation.content, error=True))
    idx = [i for i in idx if not trajs[i].steps[-1].schema_error]
    if not idx:
        return
    tok = engine.tokenizer
    by_budget: dict[int, list[int]] = {}
    for i in idx:  # each tool's budget bounds its own prompt (`fitting_prompts`); one call decodes them all
        by_budget.setdefault(p.rehearse_budget(trajs[i].steps[-1].action.name), []).append(i)
    keep: list[int] = []
    prompts: list[list[int]] = []
    budgets: list[int] = []
    for budget, group in sorted(by_budget.items()):
        fit, fit_prompts = fitting_prompts(
            engine, Role.REHEARSE, trajs, group, lambda i: rehearse_prompt_ids(
                tok, ctx, histories[i][:-1], trajs[i].steps[-1].action,
                p.grounding_examples(ctx.task_id, trajs[i].steps[-1].action, tok),
                max_observation_tokens=p.max_observation_tokens),
            budget, p)
        keep += fit
        prompts += fit_prompts
        budgets += [budget] * len(fit)
    if not keep:
        return
    # one batched call whatever the tools' budgets (`SamplingParams.prompt_max_new_tokens`: each row ends at
    # its own), so the turn decodes as long as its longest row, not one call per budget after another;
    # decoding stops once the output can no longer parse (`NotJsonStop`: same verdict, fewer tokens)
    sp = with_prompt_budgets(SamplingParams(
        temperature=p.temperature, top_p=p.top_p, seed=seeds.next(), role=Role.REHEARSE.value,
        stop_when=NotJsonStop(tok), constraints=(RehearseConstraint(tok),) * len(prompts) if p.constrained else None),
        budgets)
    for i, prompt, outs in zip(keep, prompts, engine.generate(prompts, sp)):
        gen = make_generation(Role.REHEARSE, prompt, outs[0], tok, p.temperature)
        trajs[i].generations.append(gen)
        try:
            obs = parse_rehearse(gen.text, trajs[i].steps[-1].action.name)
        except ParseError as e:
            gen.parse_error = format_error(e)
            trajs[i].termination = "parse_error"
            continue
        trajs[i].steps[-1].observation = obs
        histories[i].append(Message(role="tool", content=obs.content, error=obs.error))


def _user_turn(engine: Engine, instructions: str, trajs: list[Trajectory], histories: list[list[Message]],
               idx: list[int], p: RolloutParams, seeds: SeedStream) -> None:
    """One batched USER-REHEARSE call: the policy imagines the user's reply to ACT's message.

    A reply holding a stop token ends the trajectory ("user_stop"); an unparseable one ends it
    ("parse_error"); otherwise the trajectory continues with the reply in its history.
    """
    if not idx:
        return
    tok = engine.tokenizer
    max_new = p.max_new_tokens_user or p.max_new_tokens_act
    idx, prompts = fitting_prompts(engine, Role.USER, trajs, idx,
                                   lambda i: user_prompt_ids(tok, instructions, histories[i]), max_new, p)
    if not idx:
        return
    sp = SamplingParams(max_new_tokens=max_new, temperature=p.temperature, top_p=p.top_p, seed=seeds.next(),
                        role=Role.USER.value)
    for i, prompt, outs in zip(idx, prompts, engine.generate(prompts, sp)):
        gen = make_generation(Role.USER, prompt, outs[0], tok, p.temperature)
        trajs[i].generations.append(gen)
        try:
            turn = parse_user(gen.text, strict=p.strict)
        except ParseError as e:
            gen.parse_error = format_error(e)
            trajs[i].termination = "parse_error"
            continue
        histories[i].append(Message(role="user", content=turn.message))
        trajs[i].termination = "user_stop" if turn.stop else ""


def unroll(engine: Engine, ctx: TaskContext, history: list[Message], n: int, p: RolloutParams,
           seeds: SeedStream, memory: Optional[str] = None, user: Optional[str] = None,
           stop: Optional[Callable[[Trajectory], bool]] = None) -> list[Trajectory]:
    """n self-unfolded trajectories continuing from `history`, ACT and REHEARSE alternating.

    A trajectory ends when ACT speaks to the user ("agent_message"), an output fails to parse
    ("parse_error": METHOD.md §2, format), a role's prompt does not fit the engine's context even with
    its tool results cut ("prompt_too_long", `fitting_prompts`; masked in training), or after
    `p.max_turns` ACT turns ("max_turns").
    With `user` (the user's instructions, `roles.user_instructions`: USER-REHEARSE), ACT's message
    to the user is answered by an imagined user turn instead, and the trajectory ends when that user
    stops ("user_stop"); a message on the last allowed ACT turn still ends it as "agent_message"
    (the turn budget, not the agent, cut the conversation short of a user turn).
    With `stop`, a trajectory still running after a turn ends as `STOPPED` when ``stop(trajectory)`` is
    true (Private Rehearsal: the verifier has already rejected it, `rehearsal.agent.RehearsalAgent`).
    `seeds` is consumed one seed per engine call, so callers can share one stream across rounds.
    Rewards are not set here (see `rewards.replay_reward`).
    """
    trajs = [Trajectory(task_id=ctx.task_id, group_index=g, imagined=True) for g in range(n)]
    histories = [list(history) for _ in range(n)]
    for turn in range(p.max_turns):
        active = [i for i, t in enumerate(trajs) if not t.termination]
        calling = act_turn(engine, ctx, trajs, histories, p, seeds, memory, first=turn == 0)
        _rehearse_turn(engine, ctx, trajs, histories, calling, p, seeds)
        if user is not None and turn + 1 < p.max_turns:
            talking = [i for i in active if trajs[i].termination == "agent_message"]
            _user_turn(engine, user, trajs, histories, talking, p, seeds)
        if stop is not None:
            for i in active:
                if not trajs[i].termination and stop(trajs[i]):
                    trajs[i].termination = STOPPED
        if all(t.termination for t in trajs):
            break
    for t in trajs:
        t.termination = t.termination or "max_turns"
    return trajs


def rehearsal_rollouts(engine: Engine, ctx: TaskContext, group_size: int, p: RolloutParams,
                       seed: Optional[int] = None, memory: Optional[str] = None,
                       user: Optional[str] = None) -> list[Trajectory]:
    """G self-unfolded trajectories of one task from its first user message (one GRPO group).

    `user`: the user's instructions for USER-REHEARSE (see `unroll`); None = no imagined user turns.
    """
    start = [Message(role="user", content=ctx.first_user_message)]
    return unroll(engine, ctx, start, group_size, p, SeedStream(seed), memory, user)


def real_rollouts(engine: Engine, ctx: TaskContext, envs: list[ToolEnvironment], p: RolloutParams,
                  seed: Optional[int] = None, memory: Optional[str] = None,
                  memory_turns: Optional[int] = None) -> list[Trajectory]:
    """len(envs) trajectories, trajectory g against the real environment ``envs[g]`` (each already
    `reset` to the task, each its own private copy): ACT only, each tool call executed by `step`.

    The trajectories advance in lockstep like `unroll`'s (one batched ACT call per turn; the first
    turn is one prompt sampled G ways when G > 1), and end by the same rules: "agent_message",
    "parse_error", "prompt_too_long", "max_turns". Observations are real (`observation` =
    `real_observation`), kept whole in the trajectory; prompts show them cut to
    `p.max_observation_tokens` (the same cut as imagined ones). `memory` is in the first `memory_turns` ACT
    prompts (None: in all of them).
    """
    trajs = [Trajectory(task_id=ctx.task_id, group_index=g, imagined=False) for g in range(len(envs))]
    histories = [[Message(role="user", content=ctx.first_user_message)] for _ in envs]
    seeds = SeedStream(seed)
    for turn in range(p.max_turns):
        shown = memory if memory_turns is None or turn < memory_turns else None
        calling = act_turn(engine, ctx, trajs, histories, p, seeds, shown, first=turn == 0)
        for i in calling:
            obs: Observation = envs[i].step(trajs[i].steps[-1].action)
            trajs[i].steps[-1].observation = obs
            trajs[i].steps[-1].real_observation = obs
            histories[i].append(Message(role="tool", content=obs.content, error=obs.error))
        if all(t.termination for t in trajs):
            break
    for t in trajs:
        t.termination = t.termination or "max_turns"
    return trajs


def real_rollout(engine: Engine, ctx: TaskContext, env: ToolEnvironment, p: RolloutParams,
                 seed: Optional[int] = None, memory: Optional[str] = None,
                 memory_turns: Optional[int] = None) -> Trajectory:
    """One trajectory against the real environment `env` (already `reset` to the task): ACT only.

    Used for evaluation (Committed Execution when `memory` holds a rehearsal memory); the group
    version `real_rollouts` serves the standard-GRPO ablation. Each tool call is executed by `env.step`.
    """
    return real_rollouts(engine, ctx, [env], p, seed, memory, memory_turns)[0]


def params_from_config(cfg: RunConfig, p: RolloutParams) -> RolloutParams:
    """`p` with the budgets, the tool-format mode and the grounding settings of ``cfg.rollout``
    (max_new_tokens_user, max_observation_tokens, max_prompt_tokens, lenient_tool_format, schema_errors,
    max_new_tokens_rehearse_per_tool, grounding_k, grounding_max_tokens, constrained_decoding; the index `p.grounding`
    is kept)."""
    r = cfg.rollout
    return replace(p, max_new_tokens_user=p.max_new_tokens_user or r.max_new_tokens_user,
                   max_observation_tokens=r.max_observation_tokens, max_prompt_tokens=r.max_prompt_tokens,
                   lenient=r.lenient_tool_format, schema_errors=r.schema_errors == "observation",
                   max_new_tokens_rehearse_per_tool=dict(r.max_new_tokens_rehearse_per_tool),
                   grounding_k=r.grounding_k, grounding_max_tokens=r.grounding_max_tokens,
                   constrained=r.constrained_decoding)


def mask_unjudgeable(trajectory: Trajectory) -> Trajectory:
    """A trajectory ended by one of `MASKED_TERMINATIONS` gets ``reward=None`` (its rows are masked,
    METHOD.md §3: never scored 0 or format-penalised) and ``reward_info["masked"]`` = the termination;
    the score it would have had stays in ``reward_info["unmasked_reward"]``. Others are unchanged."""
    if trajectory.termination in MASKED_TERMINATIONS:
        trajectory.reward_info["unmasked_reward"] = trajectory.reward
        trajectory.reward_info["masked"] = trajectory.termination
        trajectory.reward, trajectory.sub_rewards = None, {}
    return trajectory


def training_group(engine: Engine, task: Task, cfg: RunConfig, p: RolloutParams, seed: Optional[int],
                   reward_fn: Optional[Callable] = None,
                   env_factory: Optional[Callable[[str], ToolEnvironment]] = None) -> list[Trajectory]:
    """One GRPO group of `task` for training, rolled out from ``cfg.rollout.source`` and scored.

    - ``"imagined"`` (World Rehearsal, default): `rehearsal_rollouts` (ACT + REHEARSE rows), with
      USER-REHEARSE rows too when ``cfg.rollout.user_rehearse`` and the task has a user scenario.
    - ``"real"`` (standard-GRPO ablation, METHOD.md §3): `real_rollouts` of ACT only, each against a
      fresh private copy ``env_factory(task.domain)`` (default `Tau2Environment`) reset to `task`; the
      real observations enter the history as context, no REHEARSE rows exist.

    `p` gets ``cfg.rollout``'s budgets and tool-format mode (`params_from_config`). Each trajectory
    is then scored by `rewards.score_trajectory` with `reward_fn` (default: the one ``cfg.reward``
    names, `rewards.reward_fn_from_config`, judge engine built on `engine`'s model),
    ``cfg.train.format_penalty`` and ``cfg.reward.replay_fidelity``; one ended "prompt_too_long" is
    then masked (`mask_unjudgeable`). Same `seed` -> same group.
    Each trajectory's ``reward_info["env_steps"]`` = {"rollout": real tool calls its rollout made (its own
    environment's; imagined: 0, or whatever this thread's environments executed during the group's
    rollouts, on the first trajectory), "reward": real tool calls made while scoring it (replays, gold
    transpositions)}, counted by `envs.base.env_steps_in_thread`.
    """
    from envace_core.envs.base import env_steps_in_thread
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.tasks import task_context

    ctx = task_context(task, cfg.data.policy_max_chars)
    p = params_from_config(cfg, p)
    G = cfg.rollout.group_size
    if cfg.rollout.source == "real":
        envs = [(env_factory or Tau2Environment)(task.domain) for _ in range(G)]
        for env in envs:
            env.reset(task)
        steps0 = [env.calls_made for env in envs]
        group = real_rollouts(engine, ctx, envs, p, seed=seed)
        rollout_steps = [env.calls_made - s0 for env, s0 in zip(envs, steps0)]
    else:
        user = user_instructions(task.user_scenario) \
            if cfg.rollout.user_rehearse and task.user_scenario else None
        before = env_steps_in_thread()
        group = rehearsal_rollouts(engine, ctx, G, p, seed=seed, user=user)
        rollout_steps = [env_steps_in_thread() - before] + [0] * (len(group) - 1)  # World Rehearsal: 0
    fn = reward_fn if reward_fn is not None else reward_fn_from_config(cfg, engine)
    out = []
    for t, n_rollout in zip(group, rollout_steps):
        rollout_info = dict(t.reward_info)  # e.g. the prompt_too_long sizes; reward functions replace reward_info
        before = env_steps_in_thread()
        score_trajectory(task, t, fn, cfg.train.format_penalty, cfg.reward.replay_fidelity)
        t.reward_info = {**rollout_info, **t.reward_info,
                         "env_steps": {"rollout": n_rollout, "reward": env_steps_in_thread() - before}}
        out.append(mask_unjudgeable(t))
    return out
