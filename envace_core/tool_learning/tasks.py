"""Tool learning's tasks (METHOD.md §5): rehearsal tasks for new tools from the domain and the user's examples, and the gate they pass."""

from __future__ import annotations

import json
import random  # A2's section keeps its own imports, so the two sections can be edited apart
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from envace_core import EnvaceError
from envace_core.types import Task, ToolCall, ToolSpec

if TYPE_CHECKING:
    pass
from envace_core.tool_learning.inputs import NewTool, ToolExample

# Why a task "needs" a new tool: its gold actions call one (METHOD.md §5). Held-out tasks are real tau2
# tasks only (scorable by replay in the real environment); tasks built from the user's examples have no
# tau2 database state and train with the `actions` reward only.
HELD_OUT_SPLIT = "test"  # the dataset split name `stages.load_dataset(..., "test")` reads as held out
_TEMPLATES = (  # opening requests built from a tool's documentation and an example's arguments
    "Hi! I'd like you to {purpose}. {details}",
    "{details} Could you {purpose} for me?",
    "Please {purpose}. {details}",
)


class AdaptationError(EnvaceError):
    """Tool learning cannot do what was asked: too few tasks, a tool with no source, bad arguments."""


class RealToolCallError(AdaptationError):
    """A real call to a new tool was attempted while adapting (the run is not registered)."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _sha(obj: Any) -> str:
    import hashlib

    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def _key(task: Task) -> str:
    """Deduplication key: normalised opening request + canonical gold actions (as `synth_candidates.Candidate.key`)."""
    return " ".join(task.first_user_message.lower().split()) + "\n" + canonical_json(
        [[a.name, a.arguments] for a in task.gold_actions])


def tool_schema_sha256(spec: ToolSpec) -> str:
    """sha256 of the tool's canonical OpenAI-format schema (sorted keys, no whitespace)."""
    return _sha(spec.openai_schema())


def examples_sha256(examples: Sequence[ToolExample]) -> str | None:
    """sha256 of the examples' canonical JSON lines, in order; None when there are none."""
    if not examples:
        return None
    return _sha([{"tool": e.call.name, "arguments": e.call.arguments, "result": e.result} for e in examples])


# ------------------------------------------------------------------------------- task builder
def _excluded_users(domain: str, test: list[Task]) -> tuple[set[str], Any]:
    """(user ids named by the domain's test split, the packaged DB) for the synth domains; (set(), None)
    elsewhere (no user table to check against)."""
    from envace_core.envs.tau2.synth import (
        SYNTH_DOMAINS,
        domain_env,
        test_users,
    )

    if domain not in SYNTH_DOMAINS:
        return set(), None
    db = domain_env(domain).tools.db
    return test_users(domain, test, db), db


def _calls_ok(calls: Sequence[tuple[str, dict]], names: set[str], blocked: set[str],
              specs: dict[str, ToolSpec]) -> bool:
    """The calls use >= 1 new tool, no blocked (hidden, not re-added) tool, and every new-tool call's
    arguments validate against the new schema (a user's schema of a domain tool may be stricter)."""
    from jsonschema import Draft202012Validator

    used = {n for n, _ in calls}
    if not used & names or used & blocked:
        return False
    return all(next(Draft202012Validator(specs[n].parameters).iter_errors(a), None) is None
               for n, a in calls if n in names)


def _scorable(task: Task) -> bool:
    """tau2 can score it offline: its reward basis is not NL assertions alone (no judge offline)."""
    basis = ((task.source or {}).get("evaluation_criteria") or {}).get("reward_basis") or []
    return bool(set(basis) - {"NL_ASSERTION"})


def _domain_tasks(domain: str, names: set[str], blocked: set[str], specs: dict[str, ToolSpec],
                  seed: int, test: list[Task], excluded: set[str], db: Any) -> Iterator[Task]:
    """The domain's real tasks that need a new tool, lazily, deterministic in `seed`: the tau2 train
    split's and `synth` candidates' (levels 1-3, each validated by running its gold,
    `synth.validate`), each list shuffled by seed, then interleaved. Never a `test` task, nor one
    that names an `excluded` (test-split) user of `db` (`synth.test_users`)."""
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.synth import (
        LEVELS,
        build_task,
        candidates,
        test_users,
        validate,
    )
    from envace_core.envs.tau2.tasks import load_tasks

    test_ids = {t.id for t in test}
    tau2 = [t for t in load_tasks(domain, "train")
            if _calls_ok([(a.name, a.arguments) for a in t.gold_actions], names, blocked, specs)
            and _scorable(t) and t.id not in test_ids
            and not (db is not None and test_users(domain, [t], db) & excluded)]
    random.Random(f"{seed}:{domain}:adapt-tau2").shuffle(tau2)
    cands = [c for lv in LEVELS for c in candidates(domain, lv, excluded, db)
             if _calls_ok(c.actions, names, blocked, specs)] if db is not None else []
    random.Random(f"{seed}:{domain}:adapt-synth").shuffle(cands)

    def synthesized() -> Iterator[Task]:
        base = Tau2Environment(domain).snapshot()
        for c in cands:
            task = build_task(domain, c)
            if task.id not in test_ids and not validate(task, base):
                yield task

    sources = [iter(tau2), synthesized()]
    while sources:  # round-robin, so neither source crowds the other out
        for it in list(sources):
            task = next(it, None)
            if task is None:
                sources.remove(it)
            else:
                yield task


def _label(name: str) -> str:
    return name.replace("_", " ").strip()


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def example_request(tool: NewTool, arguments: dict[str, Any], template: int = 0) -> str:
    """A user's opening request for `arguments` of `tool`, deterministic: the first sentence of the
    tool's documentation (lower-cased first letter) as what the user wants, and one sentence per
    argument in the schema's property order ("The first name is Yusuf."). `template` picks one of
    the phrasings `_TEMPLATES` (mod their number)."""
    doc = " ".join((tool.doc or tool.spec.description or "").split())
    first = re.split(r"(?<=[.!?])\s", doc, maxsplit=1)[0].rstrip(".!? ") if doc else ""
    purpose = (first[:1].lower() + first[1:]) if first else f"use the {tool.spec.name} tool"
    order = list(tool.spec.parameters.get("properties") or {}) + sorted(arguments)
    keys = [k for k in dict.fromkeys(order) if k in arguments]
    details = " ".join(f"The {_label(k)} is {_value(arguments[k])}." for k in keys)
    text = _TEMPLATES[template % len(_TEMPLATES)].format(purpose=purpose, details=details)
    text = " ".join(text.split())
    return text[:1].upper() + text[1:]


def _example_tasks(domain: str, tools: Sequence[NewTool], examples: Sequence[ToolExample],
                   added: list[ToolSpec], hidden: list[str]) -> list[Task]:
    """One train task per (template, example), template-major: the opening request from
    `example_request`, gold = the example call; `source` marks it as example-built (no tau2 record,
    so nothing can replay it against a tau2 database)."""
    by_name = {t.spec.name: t for t in tools}
    out = []
    for k in range(len(_TEMPLATES)):
        for i, ex in enumerate(examples):
            msg = example_request(by_name[ex.call.name], ex.call.arguments, k)
            gold = [ToolCall(name=ex.call.name, arguments=dict(ex.call.arguments), id="example_0")]
            task = Task(id="", domain=domain, split="train", first_user_message=msg, gold_actions=gold,
                        source={"envace_adapt": {"origin": "example", "example": i, "template": k}},
                        tools_added=list(added), tools_hidden=list(hidden))
            out.append(task)
    return out


def _with_id(task: Task, split: str, added: list[ToolSpec], hidden: list[str]) -> Task:
    return task.model_copy(update={"id": f"{task.domain}/adapt-{_sha(_key(task))[:12]}", "split": split,
                                   "tools_added": list(added), "tools_hidden": list(hidden)})


def build_adaptation_tasks(domain: str, tools: Sequence[NewTool], examples: Sequence[ToolExample], *,
                           n: int, seed: int = 0, held_out: float = 0.3,
                           hidden: Sequence[str] = ()) -> dict[str, list[Task]]:
    """Rehearsal training tasks that need the new `tools`, plus held-out real tasks to measure them on.

    Sources (METHOD.md §5):
      (a) for a new tool named like a tool of `domain`: the domain's real tasks whose gold actions
          call it (`_domain_tasks`: tau2's train split and `synth` candidates of levels 1-3, gold
          verified by running it; never a test-split task or user);
      (b) each of the user's `examples`: an opening request written from the tool's documentation
          and the example's arguments (`example_request`, deterministic templates, no LLM), gold =
          the example call. These have no tau2 database state: they are train-only and scored by the
          `actions` reward.
    Budget: `n` tasks in all; the examples get at least min(len(examples), n // 2) of them, the
    domain the rest (then the examples any the domain could not fill). Tasks whose gold calls a
    `hidden` domain tool that is not re-added are skipped (their context would lack it).

    Every task gets `tools_added` = the new tools' specs, `tools_hidden` = `hidden`, and id
    ``<domain>/adapt-<12 hex>`` (sha256 of the dedup key: normalised opening request + canonical gold
    actions; duplicates are dropped). Held out: round(held_out * #domain tasks) of the domain tasks
    (at least 1 when there are >= 2, or 1 plus an example task), chosen by a `seed`-ed shuffle, in
    split "test", never one naming a user the examples name (its answer would be given away); example
    tasks are only ever in "train". The table passes `gates.dataset_gate`
    (gold calls valid under the new schemas, no test-split id in train) before it is returned.

    Returns {"train": [...], "held_out": [...]} (held-out possibly empty when no new tool is a domain
    tool). Raises AdaptationError (fewer than 2 tasks: says why per tool; bad `n`/`held_out`/
    `hidden`), `gates.GateFailed` when the gate fails, `UnknownDomainError` for an unknown domain.
    """
    return build_tasks(domain, tools, examples, n, seed, held_out, hidden)[0]


def build_tasks(domain: str, tools: Sequence[NewTool], examples: Sequence[ToolExample], n: int, seed: int,
                 held_out: float, hidden: Sequence[str]) -> tuple[dict[str, list[Task]], Any]:
    """`build_adaptation_tasks` and its passing `gates.GateResult`."""
    from envace_core.envs.tau2.synth import (
        test_users,
    )
    from envace_core.envs.tau2.tasks import domain_static, load_tasks

    if n < 2:
        raise AdaptationError(f"n={n}: tool learning needs at least 2 tasks")
    if not 0 <= held_out < 1:
        raise AdaptationError(f"held_out={held_out}: the held-out share must be in [0, 1)")
    if not tools:
        raise AdaptationError("no new tools given: pass at least one tool schema")
    domain_tools = {t.name for t in domain_static(domain)[0]}
    unknown = sorted(set(hidden) - domain_tools)
    if unknown:
        raise AdaptationError(f"hidden tools {unknown} are not tools of {domain!r} "
                              f"({', '.join(sorted(domain_tools))})")
    specs = {t.spec.name: t.spec for t in tools}
    names, added, hidden = set(specs), [t.spec for t in tools], sorted(set(hidden))
    bad = sorted({e.call.name for e in examples} - names)
    if bad:
        raise AdaptationError(f"examples call {bad}, which are not among the new tools {sorted(names)}")
    blocked = set(hidden) - names
    test = load_tasks(domain, "test")
    excluded, db = _excluded_users(domain, test)
    n_ex = min(len(examples), n // 2)
    seen: set[str] = set()
    real: list[Task] = []
    if names & domain_tools:
        for t in _domain_tasks(domain, names & domain_tools, blocked, specs, seed, test, excluded, db):
            if len(real) >= n - n_ex:
                break
            if _key(t) not in seen:
                seen.add(_key(t))
                real.append(t)
    made = []
    for t in _example_tasks(domain, tools, examples, added, hidden):
        if len(made) >= n - len(real):
            break
        if db is not None and test_users(domain, [t], db) & excluded:
            continue  # an example about a test-split user would leak test data into training
        if _key(t) not in seen:
            seen.add(_key(t))
            made.append(t)
    if len(real) + len(made) < 2:
        raise AdaptationError(_too_few(domain, tools, examples, domain_tools, real, made))
    for tool in tools:
        if not any(a.name == tool.spec.name for t in real + made for a in t.gold_actions):
            print(f"[adapt-tools] WARNING: no task needs {tool.spec.name!r} "
                  f"({_why_none(tool.spec.name, domain, domain_tools, examples)})")
    order = list(range(len(real)))
    random.Random(f"{seed}:{domain}:adapt-held-out").shuffle(order)
    k = min(max(round(held_out * len(real)), 1 if held_out > 0 else 0), len(real) - (0 if made else 1))
    # A task about a user the examples name (arguments or result) would give its answer away: train only.
    ex_users = _example_users(domain, examples, db) if db is not None and examples else set()
    order = [i for i in order if not test_users(domain, [real[i]], db) & ex_users] if ex_users else order
    held_idx = set(order[:max(k, 0)])
    train = [_with_id(t, "train", added, hidden) for i, t in enumerate(real) if i not in held_idx]
    made_train, made_held = _split_implemented(made, tools, domain_tools, held_out, seed)
    train += [_with_id(t, "train", added, hidden) for t in made_train]
    held = [_with_id(real[i], HELD_OUT_SPLIT, added, hidden) for i in sorted(held_idx)]
    held += [_with_id(t, HELD_OUT_SPLIT, added, hidden) for t in made_held]
    gate = adaptation_gate(domain, train, held, blocked).raise_if_failed()
    return {"train": train, "held_out": held}, gate


def _split_implemented(made: list[Task], tools: Sequence[NewTool], domain_tools: set[str], held_out: float,
                       seed: int) -> tuple[list[Task], list[Task]]:
    """(train, held-out) of the example-built tasks. For a new tool that no tau2 domain executes but
    that has an `implementation`, round(held_out x its examples) whole examples (all their phrasings,
    so no held-out answer is trained on; at least 1 when it has 2+ examples) are held out and marked
    to be scored by running the implementation (`ImplementationEnvironment`)."""
    impl = {t.spec.name: t.implementation for t in tools if t.implementation and t.spec.name not in domain_tools}
    chosen: set[tuple[str, int]] = set()
    for name in sorted(impl):
        idx = sorted({t.source["envace_adapt"]["example"] for t in made if t.gold_actions[0].name == name})
        k = min(max(round(held_out * len(idx)), 1 if held_out > 0 else 0), len(idx) - 1)
        random.Random(f"{seed}:{name}:adapt-held-out-examples").shuffle(idx)
        chosen |= {(name, i) for i in idx[:max(k, 0)]}
    train, held = [], []
    for t in made:
        name = t.gold_actions[0].name
        if (name, t.source["envace_adapt"]["example"]) in chosen:
            mark = {**t.source["envace_adapt"], "scored_by": {name: impl[name]}}
            held.append(t.model_copy(update={"source": {"envace_adapt": mark}}))
        else:
            train.append(t)
    return train, held


def implementation_of(task: Task) -> dict[str, str] | None:
    """{tool: "module:function"} for a held-out task scored by running implementations, else None."""
    return ((task.source or {}).get("envace_adapt") or {}).get("scored_by")


def _example_users(domain: str, examples: Sequence[ToolExample], db: Any) -> set[str]:
    """User ids of `db` the examples name, in their arguments or results (`synth.test_users` rules)."""
    from envace_core.envs.tau2.synth import (
        test_users,
    )

    probes = [Task(id="probe", domain=domain, split="train", first_user_message="",
                   user_scenario=canonical_json(e.result), gold_actions=[e.call]) for e in examples]
    return test_users(domain, probes, db)


def _why_none(name: str, domain: str, domain_tools: set[str], examples: Sequence[ToolExample]) -> str:
    has_examples = any(e.call.name == name for e in examples)
    if name not in domain_tools and not has_examples:
        return f"it is neither a tool of the {domain!r} domain nor has examples; give examples of its use"
    if name in domain_tools:
        return f"no train task of {domain!r} that avoids test-split users calls it validly" + (
            "" if has_examples else "; give examples of its use")
    return "its examples duplicate other tasks"


def _too_few(domain: str, tools: Sequence[NewTool], examples: Sequence[ToolExample],
             domain_tools: set[str], real: list[Task], made: list[Task]) -> str:
    def count(name: str) -> int:
        return sum(any(a.name == name for a in t.gold_actions) for t in real + made)

    reasons = "; ".join(f"{t.spec.name}: " + (f"{count(t.spec.name)} task(s)" if count(t.spec.name) else
                                             _why_none(t.spec.name, domain, domain_tools, examples))
                        for t in tools)
    return (f"only {len(real) + len(made)} adaptation task(s) could be built for {domain!r} "
            f"({len(real)} from the domain, {len(made)} from examples); at least 2 are needed. {reasons}")


def adaptation_gate(domain: str, train: list[Task], held: list[Task], blocked: set[str] = frozenset()):
    """`gates.dataset_gate` on the adaptation table, as `stages.curate` runs it: schema, unique ids,
    valid gold calls (domain tools minus `blocked` hidden ones, plus each row's `tools_added`), no
    test-split id in train (the domain's tau2 test ids and the held-out ids), >= 2 rows. With no
    held-out task only the train split is required. Returns the `GateResult`."""
    import pandas as pd

    from envace_core.envs.tau2.tasks import domain_static, load_tasks
    from envace_core.stages.dataset import task_record
    from envace_core.stages.gates import dataset_gate

    frame = pd.DataFrame([task_record(t) for t in train + held])
    test_ids = {t.id for t in load_tasks(domain, "test")} | {t.id for t in held}
    tools = {domain: {t.name: t.parameters for t in domain_static(domain)[0] if t.name not in blocked}}
    return dataset_gate(frame, test_ids, 2, None, train_split="train",
                        test_split=HELD_OUT_SPLIT if held else "train", domains=[domain], tools=tools)
