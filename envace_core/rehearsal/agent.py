"""Private Rehearsal at test time (METHOD.md §4): rehearse in the head, then commit once.

`RehearsalAgent.run` first unrolls N imagined trajectories of the task, condenses them into a
rehearsal memory m_x under a token budget, then runs ACT against the real environment with m_x in its
context (Committed Execution). Modes:
  - "parallel": N independent imagined trajectories (one batched group, sampled at temperature > 0).
  - "sequential": rehearsal n sees rehearsals 1..n-1 and their SELF-EVALs in ACT's context (memory);
    after each, the same policy grades it (`roles.self_eval_prompt_ids`): goal reached, what stopped
    it, what to do instead. SELF-EVAL outputs are recorded as `Role.SELF_EVAL` generations on the
    rehearsal (never trained by default).
Options: `verifier` (a list of `verifier.Check`s; rejected rehearsals are left out of the memory and
listed in `RehearsalResult.rejected`), `prune_rejected` (stop a rehearsal once the verifier rejects it) and
`reenter` (rehearse again before every real ACT step, from the current real history, not only before the
first).

Isolation: rehearsal receives only the `TaskContext` (and, with `reenter`, the real history so far);
no environment handle. `run` records the environment's call counter and state hash around every
rehearsal round and raises `IsolationError` if either changed; `RehearsalResult.isolation` proves it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from envace_core import EnvaceError
from envace_core.engines.base import Engine, SamplingParams
from envace_core.envs.base import Check, ToolEnvironment
from envace_core.rehearsal.consensus import consensus_memory
from envace_core.rehearsal.verifier import verify
from envace_core.roles.bounds import MAX_OBSERVATION_TOKENS, PromptTooLong, bound_text, check_prompt, prompt_limit
from envace_core.roles.memory import memory_text
from envace_core.roles.self_eval import SelfEval, parse_self_eval, self_eval_prompt_ids
from envace_core.training.rollout import (
    RolloutParams,
    SeedStream,
    act_turn,
    make_generation,
    real_rollout,
    unroll,
)
from envace_core.types import Message, Role, Step, TaskContext, Trajectory

MODES = ("none", "parallel", "sequential")
MEMORY_CONTENTS = ("episode", "calls", "pitfalls", "consensus")  # what the memory holds (`summarise`, `consensus`)
_ROUND_SEED_STRIDE = 7919  # re-entry round r rehearses with seed + r * stride (round 0: `seed`)

T = TypeVar("T")


class IsolationError(EnvaceError):
    """Rehearsal touched the real environment (a bug: rehearsal must never do so)."""


@dataclass
class RehearsalRound:
    """One rehearsal round: before the first real ACT step (turn 0) or, with re-entry, before step `turn`.

    `rehearsals` holds every imagined trajectory (kept and rejected) in order; `self_evals` is aligned
    with it (None where no SELF-EVAL ran: rejected, or self-evaluation off); `memory` is the m_x the
    committed ACT step(s) saw.
    """

    turn: int
    rehearsals: list[Trajectory] = field(default_factory=list)
    rejected: list[tuple[Trajectory, list[str]]] = field(default_factory=list)
    self_evals: list[SelfEval | None] = field(default_factory=list)
    memory: str = ""


@dataclass
class RehearsalResult:
    """`rehearsals`/`rejected`: all rounds together; `memory`: the last round's memory (the only one
    without re-entry); `rounds`: per round; `isolation`: real calls and DB-hash change during rehearsal."""

    committed: Trajectory
    rehearsals: list[Trajectory] = field(default_factory=list)
    memory: str = ""
    isolation: dict = field(default_factory=dict)
    rejected: list[tuple[Trajectory, list[str]]] = field(default_factory=list)
    rounds: list[RehearsalRound] = field(default_factory=list)


def summarise(traj: Trajectory, k: int, tokenizer=None,
              max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS, content: str = "episode") -> str:
    """One rehearsal as compact text: the calls tried, the imagined outcomes, how it ended.

    With `tokenizer`, each outcome is cut to `max_observation_tokens` tokens with the marker of
    `roles.bounds.bound_text` (the cut ACT's and REHEARSE's prompts use), so neither the SELF-EVAL
    prompt nor a memory line holds a whole long tool result. `content` (one of `MEMORY_CONTENTS`):
    "episode" = every step and the termination; "calls" = the calls and their imagined outcomes only,
    no message to the user and no ending ("" when the rehearsal called no tool); "pitfalls" = only the
    calls its imagined environment answered with an error, with those errors ("" when none failed):
    METHOD.md §4's memory holds "constraints discovered, pitfalls", and everything else a rehearsal holds
    is imagined values (results, the answer it gave the user) that the committed run, on held-out tasks,
    copied in place of the real ones. "consensus" renders as "calls" here (what a sequential rehearsal
    sees of the earlier ones); the round's memory is then `consensus.consensus_memory`. Raises
    `EnvaceError` for another `content`.
    """
    if content not in MEMORY_CONTENTS:
        raise EnvaceError(f"unknown rehearsal memory content {content!r}; choose one of {MEMORY_CONTENTS}")
    content = "calls" if content == "consensus" else content
    lines = [f"Rehearsal {k}:"]
    for s in traj.steps:
        if s.action is not None:
            if content == "pitfalls" and not (s.observation and s.observation.error):
                continue
            obs = s.observation.content if s.observation else "(no response)"
            if tokenizer is not None and s.observation:
                obs = bound_text(obs, tokenizer, max_observation_tokens)
            lines.append(f"- called {s.action.name}({json.dumps(s.action.arguments, sort_keys=True, ensure_ascii=False)})"
                         f" -> {'ERROR ' if s.observation and s.observation.error else ''}{obs}")
        elif s.message and content == "episode":
            lines.append(f"- told the user: {s.message}")
    if content in ("calls", "pitfalls"):
        return "\n".join(lines) if len(lines) > 1 else ""
    lines.append(f"- ended: {traj.termination}")
    return "\n".join(lines)


def isolated(env: ToolEnvironment, fn: Callable[[], T]) -> T:
    """`fn()` (a rehearsal round), checked: raises `IsolationError` if `env`'s real-call counter
    (`calls_made`) or state hash (`snapshot()`) changed while it ran (METHOD.md §4, isolation)."""
    before = (env.calls_made, env.snapshot())
    out = fn()
    after = (env.calls_made, env.snapshot())
    if before != after:
        raise IsolationError(f"rehearsal changed the real environment: {before} -> {after}")
    return out


class RehearsalAgent:
    """An agent that rehearses privately before acting for real (METHOD.md §4).

    Args:
        engine: the policy's generation engine (plays ACT, REHEARSE and SELF-EVAL).
        mode: "none" (plain ACT), "parallel" or "sequential" (module docstring).
        n: number of rehearsals N per round (≥ 1 unless mode is "none").
        memory_max_tokens: token budget of the rehearsal memory (`roles.memory_text`).
        act: rollout settings of the committed execution (temperature 0 = greedy).
        rehearse: rollout settings of the rehearsals (temperature > 0 for diversity).
        seed: base seed (None: unseeded).
        verifier: checks (`verifier.Check`) every rehearsal must pass to enter the memory; None: no filter.
        reenter: rehearse again before every real ACT step, from the real history so far.
        self_eval: run SELF-EVAL after each rehearsal; None means "only in sequential mode".
        self_eval_max_tokens, self_eval_temperature: SELF-EVAL generation settings (default greedy).
        prune_rejected: with `verifier`, a rehearsal ends (termination `training.rollout.STOPPED`) after the
            turn in which the checks first reject it, instead of running to its own end: a rejected rehearsal
            enters neither the memory nor SELF-EVAL, and the consensus vote reads each rehearsal's first call
            alone, so its later turns would be decoded for nothing. The memory is then the one the whole
            rehearsal would give, provided every check is prefix-monotone (a reason found in a trajectory is
            found in each continuation of it), as all of `verifier.default_checks` are: each flags a step
            by itself or by the steps before it. The pruned rehearsal keeps its steps up to that turn and
            the reasons found by then. Sampling differs from the unpruned run (fewer engine calls consume
            fewer seeds, and smaller batches draw other tokens), not the distribution of what is kept.
        memory_content: what a kept rehearsal puts in the memory, one of `MEMORY_CONTENTS` (`summarise`);
            SELF-EVAL always sees the whole episode, and its line follows the rehearsal's block; under
            "pitfalls" a rehearsal that met no imagined error still adds its SELF-EVAL line when that names a
            blocker or advice (a constraint it found), so sequential rehearsals see it. The keyword's default
            renders the whole episode; the config's ``rehearsal.memory_content`` (what every stage, CLI and
            benchmark passes) is "pitfalls". A "consensus" memory (the call to make next) is shown to the ACT
            turn right after its round only (`memory_turns` = 1); any other stays until the next round.
    Raises:
        EnvaceError: unknown mode or memory content; n < 1 with a rehearsing mode; a verifier entry that
            is not callable.
    """

    def __init__(self, engine: Engine, mode: str, n: int, memory_max_tokens: int,
                 act: RolloutParams, rehearse: RolloutParams, seed: int | None = 0, *,
                 verifier: Sequence[Check] | None = None, reenter: bool = False,
                 self_eval: bool | None = None, self_eval_max_tokens: int = 128,
                 self_eval_temperature: float = 0.0, memory_content: str = "episode",
                 prune_rejected: bool = False):
        if mode not in MODES:
            raise EnvaceError(f"unknown rehearsal mode {mode!r}; choose one of {MODES}")
        if memory_content not in MEMORY_CONTENTS:
            raise EnvaceError(f"unknown rehearsal memory content {memory_content!r}; choose one of {MEMORY_CONTENTS}")
        if mode != "none" and n < 1:
            raise EnvaceError(f"rehearsal mode {mode!r} needs n >= 1 rehearsals, got {n}")
        if verifier is not None and not all(callable(c) for c in verifier):
            raise EnvaceError("every verifier entry must be a check function (Trajectory, TaskContext) -> reasons")
        self.engine, self.mode, self.n = engine, mode, n
        self.memory_max_tokens, self.act, self.rehearse_params, self.seed = memory_max_tokens, act, rehearse, seed
        self.verifier = list(verifier) if verifier is not None else None
        self.reenter, self.memory_content = reenter, memory_content
        self.prune_rejected = prune_rejected and self.verifier is not None
        # a consensus memory names the call to make next: the ACT turn after its round reads it, later ones do not
        self.memory_turns = 1 if memory_content == "consensus" else None
        self.self_eval = (mode == "sequential") if self_eval is None else self_eval
        self.self_eval_max_tokens, self.self_eval_temperature = self_eval_max_tokens, self_eval_temperature

    # ------------------------------------------------------------------------------------ rehearsal
    def rehearse(self, ctx: TaskContext) -> tuple[list[Trajectory], str]:
        """All imagined trajectories (kept and rejected) of one round from the task's start and the
        memory condensed from the kept ones. Touches no environment."""
        r = self.rehearse_round(ctx)
        return r.rehearsals, r.memory

    def rehearse_round(self, ctx: TaskContext, history: list[Message] | None = None,
                       prefix: Sequence[Step] = (), turn: int = 0) -> RehearsalRound:
        """One rehearsal round from `history` (default: the task's first user message).

        `prefix`: the real steps behind `history` (re-entry); checks and SELF-EVAL see them in front of
        the imagined steps, the memory summarises only the imagined ones. Touches no environment.
        """
        rnd = RehearsalRound(turn=turn)
        if self.mode == "none":
            return rnd
        history = list(history) if history else [Message(role="user", content=ctx.first_user_message)]
        seeds = SeedStream(None if self.seed is None else self.seed + turn * _ROUND_SEED_STRIDE)
        p, tok = self.rehearse_params, self.engine.tokenizer
        blocks: list[str] = []  # aligned with rnd.rehearsals; "" for a rejected one (memory_text skips it)

        def judge(trajs: list[Trajectory]) -> None:
            """Verify `trajs`, self-evaluate the kept ones, append their memory blocks."""
            base = len(rnd.rehearsals)
            views = [self._view(t, prefix) for t in trajs]
            rejected = {}
            if self.verifier is not None:
                _, rej = verify(views, ctx, self.verifier)
                rejected = {id(v): reasons for v, reasons in rej}
            kept = [i for i, v in enumerate(views) if id(v) not in rejected]
            evals: dict[int, SelfEval] = {}
            if self.self_eval and kept:
                got = self._self_evaluate(ctx, [trajs[i] for i in kept],
                                          [summarise(views[i], base + i + 1, tok, p.max_observation_tokens)
                                           for i in kept], seeds)
                evals = dict(zip(kept, got))
            for i, t in enumerate(trajs):
                rnd.rehearsals.append(t)
                rnd.self_evals.append(evals.get(i))
                if id(views[i]) in rejected:
                    rnd.rejected.append((t, rejected[id(views[i])]))
                    blocks.append("")
                else:
                    text = summarise(t, base + i + 1, tok, p.max_observation_tokens, self.memory_content)
                    ev = evals.get(i)
                    if ev is not None and ev.as_text():
                        if text:
                            text += "\n" + ev.as_text()
                        elif self.memory_content == "pitfalls" and (ev.blocker or ev.advice):
                            text = f"Rehearsal {base + i + 1}:\n{ev.as_text()}"  # a constraint it found
                    blocks.append(text)

        stop = None
        if self.prune_rejected:
            checks = self.verifier

            def stop(t: Trajectory) -> bool:
                return bool(verify([self._view(t, prefix)], ctx, checks)[1])

        if self.mode == "parallel":
            judge(unroll(self.engine, ctx, history, self.n, p, seeds, None, stop=stop))
        else:  # sequential: rehearsal k sees the memory of rehearsals 1..k-1
            for k in range(self.n):
                memory = memory_text(blocks, self.memory_max_tokens, tok)
                t = unroll(self.engine, ctx, history, 1, p, seeds, memory or None, stop=stop)[0]
                t.group_index = k
                judge([t])
        if self.memory_content != "consensus":
            rnd.memory = memory_text(blocks, self.memory_max_tokens, tok)
            return rnd
        rnd.memory = consensus_memory(rnd.rehearsals, ctx, prefix, self.verifier)
        if len(tok.encode(rnd.memory, add_special_tokens=False)) > self.memory_max_tokens:
            rnd.memory = ""  # a call longer than the budget: no memory rather than half a call
        return rnd

    @staticmethod
    def _view(t: Trajectory, prefix: Sequence[Step]) -> Trajectory:
        return t.model_copy(update={"steps": [*prefix, *t.steps]}) if prefix else t

    def _self_evaluate(self, ctx: TaskContext, trajs: list[Trajectory], summaries: list[str],
                       seeds: SeedStream) -> list[SelfEval]:
        """One batched SELF-EVAL call; each output is recorded on its trajectory as a SELF_EVAL generation.

        A prompt over `roles.bounds.prompt_limit` is not generated: its SelfEval is empty (nothing
        parsed, no memory line) and the trajectory's ``reward_info["self_eval_error"]`` names the
        `PromptTooLong`.
        """
        tok = self.engine.tokenizer
        limit = prompt_limit(self.engine, self.self_eval_max_tokens, self.rehearse_params.max_prompt_tokens)
        fits: list[tuple[Trajectory, list[int]]] = []
        skipped: dict[int, SelfEval] = {}
        for t, s in zip(trajs, summaries):
            try:
                fits.append((t, check_prompt(Role.SELF_EVAL.value, self_eval_prompt_ids(tok, ctx, s), limit)))
            except PromptTooLong as e:
                t.reward_info["self_eval_error"] = f"{type(e).__name__}: {e}"
                skipped[id(t)] = SelfEval(None, "", "", "")
        sp = SamplingParams(max_new_tokens=self.self_eval_max_tokens, temperature=self.self_eval_temperature,
                            seed=seeds.next())
        outs_all = self.engine.generate([p for _, p in fits], sp) if fits else []
        done: dict[int, SelfEval] = {}
        for (t, prompt), outs in zip(fits, outs_all):
            gen = make_generation(Role.SELF_EVAL, prompt, outs[0], tok, self.self_eval_temperature)
            ev = parse_self_eval(gen.text)
            if ev.reached_goal is None and not ev.blocker and not ev.advice:
                gen.parse_error = "InvalidSelfEval: no reached_goal, blocker or advice found"
            t.generations.append(gen)
            done[id(t)] = ev
        return [done.get(id(t)) or skipped[id(t)] for t in trajs]

    # ---------------------------------------------------------------------------------- execution
    def run(self, ctx: TaskContext, env: ToolEnvironment) -> RehearsalResult:
        """Rehearse, then commit one real execution in `env` (already reset to the task).

        With `reenter`, a round of rehearsal precedes every real ACT step. Raises `IsolationError`
        if the environment's call counter or state hash changed during any rehearsal round.
        """
        iso = {"real_calls_during_rehearsal": 0, "db_hash_unchanged": True}  # else IsolationError
        if not self.reenter or self.mode == "none":
            rnd = isolated(env, lambda: self.rehearse_round(ctx))
            committed = real_rollout(self.engine, ctx, env, self.act, seed=self.seed, memory=rnd.memory or None,
                                     memory_turns=self.memory_turns)
            return RehearsalResult(committed, rnd.rehearsals, rnd.memory, iso, rnd.rejected, [rnd])
        # Re-entry: real_rollout's loop, with a rehearsal round from the real history before each ACT step.
        traj = Trajectory(task_id=ctx.task_id, imagined=False)
        history = [Message(role="user", content=ctx.first_user_message)]
        seeds, rounds = SeedStream(self.seed), []
        for turn in range(self.act.max_turns):
            rnd = isolated(env, lambda t=turn: self.rehearse_round(ctx, history, traj.steps, t))
            rounds.append(rnd)
            if not act_turn(self.engine, ctx, [traj], [history], self.act, seeds, rnd.memory or None,
                             first=False):
                break
            obs = env.step(traj.steps[-1].action)
            traj.steps[-1].observation = obs
            traj.steps[-1].real_observation = obs
            history.append(Message(role="tool", content=obs.content, error=obs.error))
        traj.termination = traj.termination or "max_turns"
        return RehearsalResult(traj, [t for r in rounds for t in r.rehearsals], rounds[-1].memory if rounds else "",
                               iso, [x for r in rounds for x in r.rejected], rounds)
