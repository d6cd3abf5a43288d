"""ACT warm-up examples whose prompt carries a rehearsal memory (Committed Execution, METHOD.md §4).

At test time the committed ACT reads the memory m_x of the rehearsals ("# Notes from rehearsal" in its
system prompt, `roles.act_messages`); without re-entry the same m_x stays there for every real turn. The
ACT warm start (`training.sft.act_examples`) never shows such a section, so an unseen block of notes moves
the small policy's greedy choice: on held-out tasks the committed ACT copied an imagined ending ("Done.")
right after a real look-up that had succeeded (RESULTS.md, "Private Rehearsal with a per-role policy on
held-out tasks, and what the memory holds").

`act_memory_examples` builds, per train task, one memory the way `rehearsal.agent.RehearsalAgent` builds
it (`agent.summarise` of each rehearsal, `roles.memory_text` under the token budget) from two rehearsals
drawn (with the seed) among three kinds of imagined trajectory from the task's start:

- faithful: the gold calls with their real results, then the gold answer (`synth.gold_answer`);
- imagined error: the first gold call answered with the error the real environment gives a wrong variant
  of it (`transitions.wrong_calls`: a rotated id, a missing argument), then an ending that claims success;
- wrong call: that wrong variant with its real error, then the same ending.

Under ``rehearsal.memory_content="pitfalls"`` (the default) a rehearsal renders only its failed calls, so the
faithful one adds nothing and the memories hold the error kinds alone.

Every ACT turn of `act_examples` (gold calls, final answer) is repeated with this memory in its prompt
and the same target: the notes are attempts in an imagined world; the real history decides the next
action. (Behaviour cloning as `training.sft`, DeepSeekMath §4; the memory format is the test-time one.)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from envace_core.config_checks import ACT_MEMORY_KINDS
from envace_core.rehearsal.agent import MEMORY_CONTENTS, summarise
from envace_core.roles.bounds import MAX_OBSERVATION_TOKENS
from envace_core.roles.memory import memory_text
from envace_core.training.sft import SFTError, SFTExample, act_examples
from envace_core.types import Observation, Step, Task, TaskContext, ToolCall, Trajectory

if TYPE_CHECKING:
    from envace_core.envs.base import ToolEnvironment

KINDS = ACT_MEMORY_KINDS  # train.sft_act_memory_kinds' choices
SUCCESS_CLAIMS = ("Done.", "All set, it is done.", "Your request is complete.")


def _rehearsal(steps: list[Step]) -> Trajectory:
    return Trajectory(task_id="memory-example", imagined=True, steps=steps, termination="agent_message")


def rehearsal_kinds(task: Task, env: "ToolEnvironment", schemas: dict[str, dict],
                    rng: random.Random) -> dict[str, Trajectory]:
    """{kind: imagined trajectory} of `task` for each of `KINDS` that applies (module docstring): the
    faithful one always; the two error kinds when the first gold call has a wrong variant the real
    environment refuses. `env` is reset to the task here (and left in some state)."""
    from envace_core.envs.tau2.synth import gold_answer
    from envace_core.training.transitions import wrong_calls

    env.reset(task)
    faithful = []
    for k, gold in enumerate(task.gold_actions):
        call = ToolCall(name=gold.name, arguments=gold.arguments, id=f"call_{k}")
        faithful.append(Step(action=call, observation=env.step(call)))
    out = {"faithful": _rehearsal([*faithful, Step(message=gold_answer(task))])}
    first = task.gold_actions[0]
    if first.name not in schemas:
        return out
    for _, wrong in wrong_calls(first, schemas[first.name], rng):
        env.reset(task)
        obs = env.step(wrong)
        if obs.error:
            claim = Step(message=SUCCESS_CLAIMS[rng.randrange(len(SUCCESS_CLAIMS))])
            text = obs.content  # the error as it would read for the gold call's own values
            for key, value in wrong.arguments.items():
                if isinstance(value, str) and isinstance(first.arguments.get(key), str):
                    text = text.replace(value, first.arguments[key])
            out["imagined_error"] = _rehearsal([Step(action=first, observation=Observation(content=text,
                                                                                          error=True)), claim])
            out["wrong_call"] = _rehearsal([Step(action=wrong, observation=obs), claim])
            break
    return out


def act_memory_examples(tasks: Sequence[Task], tokenizer, policy_max_chars: int | None = None,
                        max_turns: int | None = None, max_tokens: int | None = None,
                        forbid_splits: Collection[str] = ("test",), seed: int = 0,
                        memory_max_tokens: int = 256, memory_content: str = "episode",
                        env_factory: Callable[[str], "ToolEnvironment"] | None = None,
                        max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS,
                        kinds: Collection[str] = KINDS) -> list[SFTExample]:
    """`training.sft.act_examples`' turns with a rehearsal memory in every prompt (module docstring).

    Per task: two rehearsal kinds drawn with `seed` among those of `kinds` that apply (one when only one
    does; none, so no example, when none does: the error kinds need a wrong variant of the first gold
    call that the real environment refuses), summarised with `memory_content` (one of `agent.MEMORY_CONTENTS`, `agent.summarise`) and joined by
    `roles.memory_text` under `memory_max_tokens` tokens, in the order drawn. The history and targets are
    those of `act_examples` (real results, first `max_turns` turns, the final answer after the last gold
    call when it fits). A task whose drawn rehearsals render to nothing (under "pitfalls" the faithful
    one does) gets no example here: it would repeat the plain one. Arguments and raises as
    `act_examples`; also `SFTError` for an unknown `memory_content` or an empty or unknown `kinds`.

    With ``kinds=("wrong_call",)`` under "pitfalls" every memory names a call that the target does not
    make: the examples teach that a call the notes mark as failed is one to avoid, where the default mix
    (the imagined error's failed call *is* the target) also rewards copying it.
    """
    from envace_core.envs.tau2.environment import Tau2Environment

    if memory_content not in MEMORY_CONTENTS:
        raise SFTError(f"unknown rehearsal memory content {memory_content!r}; choose one of {MEMORY_CONTENTS}")
    if not kinds or set(kinds) - set(KINDS):
        raise SFTError(f"rehearsal kinds {sorted(kinds)!r} for memory examples: choose one or more of {KINDS}")

    without: set[str] = set()  # tasks whose drawn rehearsals render to nothing under `memory_content`

    def memory(task: Task, ctx: TaskContext) -> str | None:
        rng = random.Random(f"memory:{seed}:{task.id}")
        env = (env_factory or Tau2Environment)(task.domain)
        made = rehearsal_kinds(task, env, {t.name: t.parameters for t in ctx.tools}, rng)
        made = {k: v for k, v in made.items() if k in kinds}
        drawn = rng.sample(sorted(made), min(2, len(made)))
        blocks = [summarise(made[k], i + 1, tokenizer, max_observation_tokens, memory_content)
                  for i, k in enumerate(drawn)]
        text = memory_text(blocks, memory_max_tokens, tokenizer)
        if not text:
            without.add(task.id)
        return text or None

    out = act_examples(tasks, tokenizer, policy_max_chars, env_factory, max_turns=max_turns, max_tokens=max_tokens,
                       forbid_splits=forbid_splits, max_observation_tokens=max_observation_tokens, memory=memory)
    return [e for e in out if e.task_id not in without]  # else a plain example again: that task weighed twice
