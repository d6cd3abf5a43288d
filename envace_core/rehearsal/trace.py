"""What Private Rehearsal did in one episode, as JSON-able dicts: every rehearsal (its calls, imagined
observations, ending, verifier reasons, SELF-EVAL), the memory of each round, and the committed trajectory.

`envace rehearse` (`rehearsal.inspect`) shows these in full; the evaluation harness
(`evaluation.tau2.opening_request_trial`) stores them, with observations, messages and memory cut to
`TRACE_MAX_CHARS`, in every
``opening_request`` record, so an episode whose outcome rehearsal changed can be read from the benchmark's
own records (METHOD.md §4: rehearsals → memory m_x → one committed execution).
"""

from __future__ import annotations

from typing import Any

TRACE_MAX_CHARS = 400  # per observation, message or memory in an evaluation record: 60 episodes stay < 1 MB


def _cut(text: Any, max_chars: int | None) -> Any:
    """`text` unchanged when it is not a str, no limit is set, or it fits; else its first `max_chars`
    characters and "… [+N chars]"."""
    if not isinstance(text, str) or max_chars is None or len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}… [+{len(text) - max_chars} chars]"


def steps(traj, max_chars: int | None = None) -> list[dict[str, Any]]:
    """A trajectory's steps in order: {"call": {name, arguments}, "observation": text or None, "error": bool}
    for a tool call, {"message": text} for a message to the user. Texts cut to `max_chars` (None: whole)."""
    out = []
    for s in traj.steps:
        if s.action is not None:
            obs = s.observation
            out.append({"call": {"name": s.action.name, "arguments": s.action.arguments},
                        "observation": _cut(obs.content if obs else None, max_chars),
                        "error": bool(obs and obs.error)})
        else:
            out.append({"message": _cut(s.message, max_chars)})
    return out


def parse_errors(traj) -> list[str]:
    """"<role>: <error>" for each generation of `traj` whose output did not parse."""
    return [f"{g.role.value}: {g.parse_error}" for g in traj.generations if g.parse_error]


def rounds(result_rounds, max_chars: int | None = None) -> list[dict[str, Any]]:
    """`RehearsalResult.rounds` as dicts: {"turn", "memory", "rehearsals": [{"index" (1-based), "steps",
    "termination", "rejected", "reasons" (the verifier's), "self_eval" ({reached_goal, blocker, advice, raw}
    or None: none ran), "parse_errors"}]}. Observations, messages, memory and the SELF-EVAL texts are cut to
    `max_chars` (None: whole); call arguments (bounded by ACT's token budget) and reasons are kept whole."""
    out = []
    for rnd in result_rounds:
        rejected = {id(t): reasons for t, reasons in rnd.rejected}
        rehs = []
        for k, t in enumerate(rnd.rehearsals, 1):
            ev = rnd.self_evals[k - 1] if k <= len(rnd.self_evals) else None
            rehs.append({"index": k, "steps": steps(t, max_chars), "termination": t.termination,
                         "rejected": id(t) in rejected, "reasons": rejected.get(id(t), []),
                         "self_eval": None if ev is None else {
                             "reached_goal": ev.reached_goal, "blocker": _cut(ev.blocker, max_chars),
                             "advice": _cut(ev.advice, max_chars), "raw": _cut(ev.raw, max_chars)},
                         "parse_errors": parse_errors(t)})
        out.append({"turn": rnd.turn, "rehearsals": rehs, "memory": _cut(rnd.memory, max_chars)})
    return out


def episode(result_rounds, committed, max_chars: int | None = TRACE_MAX_CHARS) -> dict[str, Any]:
    """One episode: {"rounds": `rounds(...)`, "committed": {"steps", "termination", "parse_errors"}}."""
    return {"rounds": rounds(result_rounds, max_chars),
            "committed": {"steps": steps(committed, max_chars), "termination": committed.termination,
                          "parse_errors": parse_errors(committed)}}
