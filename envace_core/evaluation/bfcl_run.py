"""Running BFCL: single-turn and multi-turn episodes (with optional Private Rehearsal) and `evaluate_bfcl`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from envace_core.engines.base import SamplingParams
from envace_core.envs.bfcl import (
    BfclMultiTurnEnv,
    bfcl_tool_spec,
    check_multi_turn,
    import_bfcl,
)
from envace_core.evaluation.bfcl import (
    MULTI_TURN_CATEGORIES,
    BfclEntry,
    DecodeError,
    bfcl_prompt_ids,
    bfcl_task,
    decode_calls,
    load_bfcl,
    resolve_category,
    score_single_turn,
)
from envace_core.evaluation.bfcl_results import (
    BfclReport,
    CategoryResult,
    EntryResult,
    overall_leaves,
    overall_scores,
    tally,
)
from envace_core.rehearsal.agent import RehearsalAgent, isolated
from envace_core.types import Message, Step, TaskContext, ToolCall


# ---------------------------------------------------------------------------------------- evaluation
def _generate(engine, prompts: list[list[int]], params: SamplingParams, batch_size: int) -> list[tuple[str, str]]:
    tok = engine.tokenizer
    out: list[tuple[str, str]] = []
    for i in range(0, len(prompts), max(1, batch_size)):
        for comps in engine.generate(prompts[i:i + batch_size], params):
            c = comps[0]
            out.append((tok.decode(c.token_ids, skip_special_tokens=True), c.finish_reason))
    return out


def _history(turn_messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m.get("content", "")} for m in turn_messages]


def _run_single_turn(engine, entries: list[BfclEntry], params: SamplingParams, batch_size: int,
                     keep_output_chars: int) -> CategoryResult:
    tok = engine.tokenizer
    cat = entries[0].category if entries else ""
    res = CategoryResult(category=cat)
    prompts = []
    for e in entries:
        tools = [bfcl_tool_spec(f) for f in e.functions]
        prompts.append(bfcl_prompt_ids(tok, tools, _history(e.question[0]), multi_turn=False))
    for e, (text, finish) in zip(entries, _generate(engine, prompts, params, batch_size)):
        try:
            calls, reason = decode_calls(text, e.functions), ""
        except DecodeError as err:
            calls, reason = None, err.reason
        verdict = score_single_turn(e, calls)
        if reason:
            outcome = "decode_error"
        elif verdict["valid"]:
            outcome = "correct"
        elif not calls:
            outcome = "no_call"
        else:
            outcome = "wrong"
        res.entries.append(EntryResult(
            id=e.id, valid=verdict["valid"], outcome=outcome, error_type=verdict["error_type"],
            error="; ".join(verdict["error"])[:500], decode_errors=1 if reason else 0,
            decode_reasons=[reason] if reason else [], output=text[:keep_output_chars], calls=calls,
            truncated=int(finish == "length")))
    return tally(res)


class _Episode:
    """One multi-turn entry being played: our agent on `BfclMultiTurnEnv`, bfcl's inference loop.

    Per user turn (bfcl's `inference_multi_turn_prompting`): the turn's user message (for a miss_func
    holdout turn, bfcl's "additional functions" message, and the revealed tools join the prompt); then
    steps: generate, decode, stop the turn on no call or a decode error, otherwise execute the calls and
    add their results; more than `max_steps` steps in one turn force-terminates the entry.

    With `rehearsal` (mode other than "none"), `rehearse` runs a rehearsal round before the turn's first
    step (every step with `rehearsal.reenter`); its memory enters every prompt until the next round.
    The round sees `messages` (the real history as our `Message`s, one assistant message per executed
    call followed by its result), the current turn's real `Step`s as its prefix, and a `TaskContext`
    whose `first_user_message` is the current turn's request (what SELF-EVAL judges the rehearsal by).
    """

    def __init__(self, entry: BfclEntry, max_steps: int, rehearsal: RehearsalAgent | None = None):
        self.entry, self.max_steps = entry, max_steps
        self.rehearsal = rehearsal if rehearsal is not None and rehearsal.mode != "none" else None
        self.env = BfclMultiTurnEnv()
        self.task = bfcl_task(entry)
        self.env.reset(self.task)
        self.history: list[dict] = []
        self.messages: list[Message] = []  # the same history for rehearsal (module docstring)
        self.turn_steps: list[Step] = []
        self.request = ""
        self.memory = ""
        self.due = False  # a rehearsal round is due before the next step
        self.stats: dict[str, int] = {"rounds": 0, "rehearsals": 0, "rejected": 0}
        self.turn = -1
        self.count = 0
        self.done = False
        self.force_terminated = False
        self.decode_reasons: list[str] = []
        self.truncated = 0
        self._next_turn()

    def _next_turn(self) -> None:
        self.turn += 1
        self.count = 0
        if self.turn >= len(self.entry.question):
            self.done = True
            return
        revealed = self.env.begin_turn()
        msgs = _history(self.entry.question[self.turn])
        if revealed:
            tpl = import_bfcl().DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING
            msgs = [{"role": "user", "content": tpl.format(functions=json.dumps(revealed, ensure_ascii=False))}]
        self.history += msgs
        users = [str(m["content"]) for m in msgs if m["role"] == "user"]
        self.messages += [Message(role="user", content=u) for u in users]
        self.request = "\n".join(users) or self.request
        self.turn_steps = []
        self.due = True

    def context(self) -> TaskContext:
        """What a rehearsal may see: the tools visible now, bfcl's policy line, the current request."""
        return TaskContext(task_id=self.task.id, domain="bfcl", policy=self.env.policy(), tools=self.env.tools(),
                           first_user_message=self.request)

    def rehearse(self) -> None:
        """One rehearsal round in imagination if one is due (class docstring); raises
        `rehearsal.IsolationError` if the real env's call counter or state hash changed during it."""
        agent = self.rehearsal
        if agent is None or self.done or not (self.due or agent.reenter):
            return
        self.due = False
        ctx, history, prefix, k = self.context(), list(self.messages), list(self.turn_steps), self.stats["rounds"]
        rnd = isolated(self.env, lambda: agent.rehearse_round(ctx, history, prefix, k))
        self.memory = rnd.memory
        self.stats["rounds"] += 1
        self.stats["rehearsals"] += len(rnd.rehearsals)
        self.stats["rejected"] += len(rnd.rejected)

    def prompt_ids(self, tokenizer) -> list[int]:
        return bfcl_prompt_ids(tokenizer, self.env.tools(), self.history, multi_turn=True, memory=self.memory or None)

    def advance(self, text: str, finish: str) -> None:
        if self.rehearsal is not None and self.rehearsal.memory_turns == 1:
            self.memory = ""  # a consensus memory serves the ACT step after its round only
        self.truncated += finish == "length"
        self.history.append({"role": "assistant", "content": text})
        try:
            calls = decode_calls(text, self.env.tools())
        except DecodeError as err:
            self.decode_reasons.append(err.reason)
            calls = []
        if not calls:
            if text.strip():
                self.messages.append(Message(role="assistant", content=text.strip()))
            self._next_turn()
            return
        pairs = [(name, args) for c in calls for name, args in c.items()]
        tool_calls = [ToolCall(name=name, arguments=args, id=f"call_{self.turn}_{self.count}_{i}")
                      for i, (name, args) in enumerate(pairs)]
        for call, obs in zip(tool_calls, self.env.step_calls(tool_calls)):
            self.history.append({"role": "tool", "content": obs.content})
            self.messages += [Message(role="assistant", tool_call=call),
                              Message(role="tool", content=obs.content, error=obs.error)]
            self.turn_steps.append(Step(action=call, observation=obs, real_observation=obs))
        self.count += 1
        if self.count > self.max_steps:
            self.force_terminated = True
            self.done = True

    def result(self) -> EntryResult:
        try:
            r = check_multi_turn(self.entry.raw, self.env.turn_calls, self.entry.ground_truth)
        finally:
            self.env.close()
        valid = bool(r.get("valid"))
        outcome = "correct" if valid else ("force_terminated" if self.force_terminated else "wrong")
        reh = None
        if self.rehearsal is not None:
            reh = {"mode": self.rehearsal.mode, "n": self.rehearsal.n, "reenter": self.rehearsal.reenter,
                   **self.stats, "memory_chars": len(self.memory), "real_calls_during_rehearsal": 0}
        return EntryResult(id=self.entry.id, valid=valid, outcome=outcome,
                           error_type="" if valid else str(r.get("error_type", "")),
                           error="" if valid else str(r.get("error_message", ""))[:500],
                           decode_errors=len(self.decode_reasons), decode_reasons=self.decode_reasons,
                           calls=self.env.turn_calls, truncated=self.truncated, rehearsal=reh)


def run_multi_turn(engine, entries: list[BfclEntry], params: SamplingParams, batch_size: int = 4,
                   max_steps: int | None = None, rehearsal: RehearsalAgent | None = None,
                   on_entry: Callable[[EntryResult], None] | None = None) -> CategoryResult:
    """Play multi-turn `entries` (one category) with bfcl's loop and score each with bfcl's checker.

    Up to `batch_size` episodes advance in lockstep (one batched generation per step); `max_steps` per
    user turn (default bfcl's `MAXIMUM_STEP_LIMIT`). `rehearsal`: Private Rehearsal per `_Episode`
    (rounds run one episode at a time, before the batched step). `on_entry` is called with each entry's
    result as soon as it is scored (per-entry resume caches). Entries are reported in input order.
    Raises `rehearsal.IsolationError` if a rehearsal round touched a real environment.
    """
    tok = engine.tokenizer
    steps = import_bfcl().MAXIMUM_STEP_LIMIT if max_steps is None else int(max_steps)
    res = CategoryResult(category=entries[0].category if entries else "")
    pending = list(entries)
    active: list[_Episode] = []
    while pending or active:
        while pending and len(active) < max(1, batch_size):
            active.append(_Episode(pending.pop(0), steps, rehearsal))
        live = [ep for ep in active if not ep.done]
        for ep in live:
            ep.rehearse()
        if live:
            outs = _generate(engine, [ep.prompt_ids(tok) for ep in live], params, batch_size)
            for ep, (text, finish) in zip(live, outs):
                ep.advance(text, finish)
        for ep in [ep for ep in active if ep.done]:
            active.remove(ep)
            res.entries.append(ep.result())
            if on_entry is not None:
                on_entry(res.entries[-1])
    order = {e.id: i for i, e in enumerate(entries)}
    res.entries.sort(key=lambda r: order[r.id])
    return tally(res)


def sampling_params(engine, max_new_tokens: int = 512, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
    """`evaluate_bfcl`'s sampling: `temperature` (0 = greedy), `max_new_tokens`, `seed`; the tokenizer's
    eos stops."""
    eos = getattr(engine.tokenizer, "eos_token_id", None)
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=1, seed=seed,
                          stop_token_ids=(int(eos),) if eos is not None else ())


def evaluate_bfcl(engine, categories: Sequence[str], limit_per_category: int | None = None, *,
                  max_new_tokens: int = 512, temperature: float = 0.0, seed: int = 0, batch_size: int = 8,
                  max_steps: int | None = None, keep_output_chars: int = 2000,
                  progress: Callable[[str, CategoryResult], None] | None = None,
                  rehearsal: RehearsalAgent | None = None) -> BfclReport:
    """Run our policy (`engine`, the `Engine` protocol) on BFCL categories and score them with bfcl.

    Single-turn categories: one generation per entry (batched by `batch_size`), `decode_calls`, then
    `score_single_turn`; never rehearsed. Multi-turn categories: `run_multi_turn` (an `_Episode` per
    entry: bfcl's inference loop on `BfclMultiTurnEnv`, at most `max_steps` steps per turn, default bfcl's
    `MAXIMUM_STEP_LIMIT` = 20; episodes batched in lockstep; Private Rehearsal with `rehearsal`), then
    bfcl's `multi_turn_checker` via `check_multi_turn`.
    Sampling (`sampling_params`): `temperature` (0 = greedy), `max_new_tokens`, `seed`; eos stops.

    Returns a `BfclReport`: per category accuracy, decode errors (separately), error types; bfcl's groups;
    `overall` in bfcl's weighting (`overall_scores`). Raises `UnsupportedCategory` for a category not run,
    `rehearsal.IsolationError` if a rehearsal round touched a real environment.
    """
    cats = [resolve_category(c) for c in categories]
    params = sampling_params(engine, max_new_tokens, temperature, seed)
    report = BfclReport(limit_per_category=limit_per_category)
    for cat in dict.fromkeys(cats):
        entries = load_bfcl(cat, limit_per_category)
        if cat in MULTI_TURN_CATEGORIES:
            res = run_multi_turn(engine, entries, params, batch_size, max_steps, rehearsal)
        else:
            res = _run_single_turn(engine, entries, params, batch_size, keep_output_chars)
        res.category = cat
        report.categories[cat] = res
        if progress is not None:
            progress(cat, res)
    scores = {c: {"accuracy": r.accuracy, "total_count": r.n} for c, r in report.categories.items() if r.n}
    overall, groups = overall_scores(scores)
    report.overall = float(overall["accuracy"]) if overall else 0.0
    evaluated, groups_evaluated = overall_scores(scores, only_evaluated=True)
    report.overall_evaluated = None if evaluated is None else float(evaluated["accuracy"])
    report.groups, report.groups_evaluated = groups, groups_evaluated
    report.missing_categories = [c for c in overall_leaves() if c not in scores]
    report.complete = not report.missing_categories and limit_per_category is None
    return report
