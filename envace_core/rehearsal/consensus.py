"""The consensus memory of a rehearsal round: the grounded first call most rehearsals began with.

METHOD.md §4 condenses the N rehearsals of a round into a memory m_x for the committed ACT. Under
``rehearsal.memory_content="consensus"`` m_x names one call (`HEADER` and the call's line): the first tool
call that most of the round's rehearsals made, among those

- that pass the round's verifier on that call alone (the call's schema and the domain's policy rules;
  what REHEARSE imagined after it is not what is voted on), and
- whose argument values all occur in what the agent was told (`verifier.grounded`: the user's request
  and the real results of a re-entry prefix), so that an identifier the policy made up cannot win (a call
  with no argument value, e.g. a tool without parameters, is eligible). The match is case-folded and by
  whole words, as `verifier.grounded_error_check`'s: a case-changed identifier still counts as stated, and
  equal values written differently (2 and 2.0, a trailing space) vote apart.

"Most" is a plurality: one vote wins when every eligible call differs, and the memory says how many of
the N rehearsals agreed. Ties go to the call made first. A round with no such call has an empty memory
(the committed run is the one without rehearsal). The rest of each rehearsal (imagined results, later calls built on imagined
values, messages) is left out: on held-out tasks the committed ACT of a 135M policy copies the calls a
memory names, imagined values included (benchmarks/RESULTS.md, "An ACT warmed with pitfall memories").
The vote over sampled first actions is self-consistency (Wang et al. 2022, §2) applied to one tool
call; REHEARSE contributes nothing to it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from envace_core.envs.base import Check
from envace_core.rehearsal.verifier import grounded, verify
from envace_core.types import Step, TaskContext, ToolCall, Trajectory

HEADER = "Rehearsal consensus: {k} of {n} rehearsals began with"


def grounding_text(ctx: TaskContext, prefix: Sequence[Step] = ()) -> str:
    """What the agent was told before the rehearsals began, case-folded: the opening request and each
    successful real result of `prefix` (as `verifier.grounded_error_check` reads them)."""
    text = ctx.first_user_message.casefold()
    for s in prefix:
        if s.observation is not None and not s.observation.error:
            text += "\n" + s.observation.content.casefold()
    return text


def call_key(call: ToolCall) -> str:
    """A call's identity for the vote: its name and its arguments with sorted keys."""
    return f"{call.name}({json.dumps(call.arguments, sort_keys=True, ensure_ascii=False)})"


def first_call_consensus(rehearsals: Sequence[Trajectory], ctx: TaskContext, prefix: Sequence[Step] = (),
                         checks: Sequence[Check] | None = None) -> tuple[ToolCall, int] | None:
    """(call, votes): the most frequent first call of `rehearsals` (their own first step, after `prefix`)
    among the eligible ones (module docstring; `checks` None = no verifier), or None when none is. A
    rehearsal whose first step is no tool call (ACT spoke, or its output did not parse) does not vote."""
    told = grounding_text(ctx, prefix)
    votes: dict[str, list[ToolCall]] = {}
    for t in rehearsals:
        if not t.steps or t.steps[0].action is None or t.steps[0].schema_error is not None:
            continue
        call = t.steps[0].action
        if not grounded(call.arguments, told, empty=True):  # a call with no value to make up is eligible
            continue
        if checks is not None:
            alone = t.model_copy(update={"steps": [*prefix, t.steps[0].model_copy(update={"observation": None})],
                                         "generations": []})
            if not verify([alone], ctx, checks)[0]:
                continue
        votes.setdefault(call_key(call), []).append(call)
    if not votes:
        return None
    best = max(votes.values(), key=len)  # dicts keep insertion order: the first-made call wins a tie
    return best[0], len(best)


def consensus_memory(rehearsals: Sequence[Trajectory], ctx: TaskContext, prefix: Sequence[Step] = (),
                     checks: Sequence[Check] | None = None) -> str:
    """m_x under "consensus": two lines, `HEADER` and ``- called NAME({args})`` (the rendering of
    `agent.summarise`), or "" when no rehearsal's first call is eligible (`first_call_consensus`)."""
    got = first_call_consensus(rehearsals, ctx, prefix, checks)
    if got is None:
        return ""
    call, k = got
    return f"{HEADER.format(k=k, n=len(rehearsals))}\n- called {call_key(call)}"
