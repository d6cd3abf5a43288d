"""Rollouts: self-unfolded rehearsal trajectories (training, Private Rehearsal) and real ones.

Self-unfolded (METHOD.md §1): ACT emits a_t from h_t; REHEARSE, the same policy, imagines ô_t from
(h_t, a_t); h_{t+1} = h_t ⊕ (a_t, ô_t). No environment is reachable from here: the functions take a
`TaskContext` (tools, policy text, first user message) and an engine, never an environment handle.
A group's G trajectories advance in lockstep so each turn is one batched engine call per role; the
first ACT turn of a group is one prompt sampled G ways (its prefix is computed once).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from envace_core import roles
from envace_core.engines.base import Completion, Engine, SamplingParams
from envace_core.envs.base import ToolEnvironment
from envace_core.types import Generation, Message, Observation, Role, Step, TaskContext, Trajectory


@dataclass(frozen=True)
class RolloutParams:
    max_turns: int
    max_new_tokens_act: int
    max_new_tokens_rehearse: int
    temperature: float
    top_p: float = 1.0
    strict: bool = True


def _generation(role: Role, prompt: list[int], c: Completion, tokenizer, temperature: float) -> Generation:
    return Generation(role=role, prompt_ids=list(prompt), completion_ids=list(c.token_ids),
                      logprobs=list(c.logprobs), temperature=temperature if temperature > 0 else 1.0,
                      text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                      finish_reason=c.finish_reason)


class _Seeds:
    """A deterministic stream of per-call seeds from one base seed (same seed → same rollouts)."""

    def __init__(self, seed: Optional[int]):
        self._it = itertools.count(seed) if seed is not None else None

    def next(self) -> Optional[int]:
        return next(self._it) if self._it is not None else None


def _act_turn(engine: Engine, ctx: TaskContext, trajs: list[Trajectory], histories: list[list[Message]],
              p: RolloutParams, seeds: _Seeds, memory: Optional[str], first: bool) -> list[int]:
    """One batched ACT call for the active trajectories; returns the indices that called a tool."""
    tok = engine.tokenizer
    sp = SamplingParams(max_new_tokens=p.max_new_tokens_act, temperature=p.temperature, top_p=p.top_p,
                        seed=seeds.next())
    active = [i for i, t in enumerate(trajs) if not t.termination]
    if first and len(active) > 1:  # identical prompts: one prompt, n samples, prefix computed once
        prompt = roles.act_prompt_ids(tok, ctx, histories[active[0]], memory)
        outs = engine.generate([prompt], SamplingParams(**{**sp.__dict__, "n": len(active)}))[0]
        prompts = [prompt] * len(active)
    else:
        prompts = [roles.act_prompt_ids(tok, ctx, histories[i], memory) for i in active]
        outs = [o[0] for o in engine.generate(prompts, sp)] if prompts else []
    calling = []
    for i, prompt, c in zip(active, prompts, outs):
        gen = _generation(Role.ACT, prompt, c, tok, p.temperature)
        trajs[i].generations.append(gen)
        try:
            out = roles.parse_act(gen.text, ctx.tools, strict=p.strict)
        except roles.ParseError as e:
            gen.parse_error = roles.format_error(e)
            trajs[i].termination = "parse_error"
            continue
        if out.tool_call is None:
            trajs[i].steps.append(Step(message=out.message))
            histories[i].append(Message(role="assistant", content=out.message))
            trajs[i].termination = "agent_message"
        else:
            out.tool_call.id = f"call_{len(trajs[i].steps)}"
            trajs[i].steps.append(Step(action=out.tool_call))
            histories[i].append(Message(role="assistant", tool_call=out.tool_call))
            calling.append(i)
    return calling


def _rehearse_turn(engine: Engine, ctx: TaskContext, trajs: list[Trajectory],
                   histories: list[list[Message]], idx: list[int], p: RolloutParams, seeds: _Seeds) -> None:
    """One batched REHEARSE call: the policy imagines the tool response of each pending call."""
    if not idx:
        return
    tok = engine.tokenizer
    prompts = [roles.rehearse_prompt_ids(tok, ctx, histories[i][:-1], trajs[i].steps[-1].action)
               for i in idx]
    sp = SamplingParams(max_new_tokens=p.max_new_tokens_rehearse, temperature=p.temperature,
                        top_p=p.top_p, seed=seeds.next())
    for i, prompt, outs in zip(idx, prompts, engine.generate(prompts, sp)):
        gen = _generation(Role.REHEARSE, prompt, outs[0], tok, p.temperature)
        trajs[i].generations.append(gen)
        try:
            obs = roles.parse_rehearse(gen.text)
        except roles.ParseError as e:
            gen.parse_error = roles.format_error(e)
            trajs[i].termination = "parse_error"
            continue
        trajs[i].steps[-1].observation = obs
        histories[i].append(Message(role="tool", content=obs.content, error=obs.error))


def unroll(engine: Engine, ctx: TaskContext, history: list[Message], n: int, p: RolloutParams,
           seeds: _Seeds, memory: Optional[str] = None) -> list[Trajectory]:
    """n self-unfolded trajectories continuing from `history`, ACT and REHEARSE alternating.

    A trajectory ends when ACT speaks to the user ("agent_message"), an output fails to parse
    ("parse_error": METHOD.md §2, format), or after `p.max_turns` ACT turns ("max_turns").
    `seeds` is consumed one seed per engine call, so callers can share one stream across rounds.
    Rewards are not set here (see `rewards.replay_reward`).
    """
    trajs = [Trajectory(task_id=ctx.task_id, group_index=g, imagined=True) for g in range(n)]
    histories = [list(history) for _ in range(n)]
    for turn in range(p.max_turns):
        calling = _act_turn(engine, ctx, trajs, histories, p, seeds, memory, first=turn == 0)
        _rehearse_turn(engine, ctx, trajs, histories, calling, p, seeds)
        if all(t.termination for t in trajs):
            break
    for t in trajs:
        t.termination = t.termination or "max_turns"
    return trajs


def rehearsal_rollouts(engine: Engine, ctx: TaskContext, group_size: int, p: RolloutParams,
                       seed: Optional[int] = None, memory: Optional[str] = None) -> list[Trajectory]:
    """G self-unfolded trajectories of one task from its first user message (one GRPO group)."""
    start = [Message(role="user", content=ctx.first_user_message)]
    return unroll(engine, ctx, start, group_size, p, _Seeds(seed), memory)


def real_rollout(engine: Engine, ctx: TaskContext, env: ToolEnvironment, p: RolloutParams,
                 seed: Optional[int] = None, memory: Optional[str] = None) -> Trajectory:
    """One trajectory against the real environment `env` (already `reset` to the task): ACT only.

    Used for evaluation (Committed Execution when `memory` holds a rehearsal memory) and for the
    standard-GRPO ablation. Each tool call is executed by `env.step`.
    """
    traj = Trajectory(task_id=ctx.task_id, imagined=False)
    history = [Message(role="user", content=ctx.first_user_message)]
    seeds = _Seeds(seed)
    for _ in range(p.max_turns):
        if not _act_turn(engine, ctx, [traj], [history], p, seeds, memory, first=False):
            break
        obs: Observation = env.step(traj.steps[-1].action)
        traj.steps[-1].observation = obs
        traj.steps[-1].real_observation = obs
        history.append(Message(role="tool", content=obs.content, error=obs.error))
    traj.termination = traj.termination or "max_turns"
    return traj
