"""VitaBench tasks and `VitaEnvironment`: loading the task files and serving their tools from the task's database."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.base import RewardResult, ToolEnvironment
from envace_core.roles.errors import InvalidArguments
from envace_core.roles.tools import validate_arguments
from envace_core.types import Observation, Step, Task, TaskContext, ToolCall, ToolSpec

WINDOW_SIZE = 10
WINDOW_OVERLAP = 2
SEARCH_LIMIT = 10
_REQUIRED = {"id": str, "domain": str, "environment": dict, "instructions": str}


# ------------------------------------------------------------------------------------------ loading
def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_")


# The task files spell one domain several ways (instore/tasks_en.json: "instore" 73, "in-store consumption"
# 25, "in-store" 2); tasks get one canonical name, the record keeps its own spelling.
_DOMAIN_ALIASES = {"in_store": "instore", "in_store_consumption": "instore", "instore": "instore",
                   "delivery": "delivery", "ota": "ota", "online_travel": "ota", "online_travel_agency": "ota"}


def canonical_domain(domain: str) -> str:
    """VitaBench domain name as used in task ids: known spellings map to `delivery` / `instore` / `ota`;
    anything else (e.g. cross-domain files) is lower-cased with non-alphanumeric runs turned into "_"."""
    slug = _slug(domain)
    return _DOMAIN_ALIASES.get(slug, slug)


def _check_record(rec: Any, where: str) -> None:
    if not isinstance(rec, dict):
        raise EnvaceError(f"{where}: a task must be a JSON object, got {type(rec).__name__}")
    for key, typ in _REQUIRED.items():
        if key not in rec:
            raise EnvaceError(f"{where}: missing field {key!r}")
        if not isinstance(rec[key], typ):
            raise EnvaceError(f"{where}: field {key!r} must be a {typ.__name__}, got {type(rec[key]).__name__}")
    ec = rec.get("evaluation_criteria")
    if ec is not None:
        if not isinstance(ec, dict):
            raise EnvaceError(f"{where}: field 'evaluation_criteria' must be an object")
        for key in ("expected_states", "overall_rubrics"):
            if ec.get(key) is not None and not isinstance(ec[key], list):
                raise EnvaceError(f"{where}: field 'evaluation_criteria.{key}' must be a list")
    us = rec.get("user_scenario")
    if us is not None and not isinstance(us, dict):
        raise EnvaceError(f"{where}: field 'user_scenario' must be an object")
    if rec.get("message_history") is not None and not isinstance(rec["message_history"], list):
        raise EnvaceError(f"{where}: field 'message_history' must be a list")


def _to_task(rec: dict[str, Any]) -> Task:
    scenario = {"user_profile": (rec.get("user_scenario") or {}).get("user_profile"),
                "instructions": rec["instructions"]}
    return Task(
        id=f"vitabench/{canonical_domain(rec['domain'])}/{rec['id']}",
        domain=canonical_domain(rec["domain"]),
        split="test",
        first_user_message=rec["instructions"].strip(),
        user_scenario=json.dumps(scenario, sort_keys=True, ensure_ascii=False),
        gold_actions=[],
        source=copy.deepcopy(rec),
    )


def load_vitabench(path: str | Path, pattern: str = "tasks_en.json") -> list[Task]:
    """Load VitaBench tasks from a task file (a JSON list of task records) or a directory (every file
    named `pattern` under it, recursively, in sorted path order).

    Each record becomes a `Task`: `id` = "vitabench/<domain>/<record id>", `domain` =
    `canonical_domain(record["domain"])`, `split` = "test", `first_user_message` = `instructions` (the user simulator's goal, used
    verbatim as the opening request, the convention of our tau2 adapter, until a user simulator is plugged
    in), `user_scenario` = JSON of {user_profile, instructions}, `gold_actions` = [] (VitaBench has none),
    `source` = the record (with `environment` and `evaluation_criteria`; scoring / environment only).

    Raises `EnvaceError` naming the file and field: a missing path, no matching files, invalid JSON, a file
    that is not a list, a record missing `id` / `domain` / `environment` / `instructions` (or of the wrong
    type), malformed `evaluation_criteria`, or a duplicate task id.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise EnvaceError(f"VitaBench path {p} does not exist")
    files = sorted(p.rglob(pattern)) if p.is_dir() else [p]
    if not files:
        raise EnvaceError(f"no VitaBench task files named {pattern!r} under {p} (VitaBench's data folder has "
                          f"one per domain, e.g. delivery/{pattern})")
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for f in files:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as e:
            raise EnvaceError(f"{f}: not valid JSON: {e}") from None
        if not isinstance(data, list):
            raise EnvaceError(f"{f}: a VitaBench task file must hold a JSON list of tasks")
        for i, rec in enumerate(data):
            where = f"{f}: task {i}" + (f" (id {rec.get('id')!r})" if isinstance(rec, dict) and "id" in rec else "")
            _check_record(rec, where)
            t = _to_task(rec)
            if t.id in seen:
                raise EnvaceError(f"{where}: task id {t.id!r} already loaded from {seen[t.id]}")
            seen[t.id] = str(f)
            tasks.append(t)
    return tasks


def vita_source(task: Task) -> dict[str, Any]:
    env = task.source.get("environment") if isinstance(task.source, dict) else None
    if not isinstance(env, dict):
        raise EnvaceError(f"task {task.id!r} has no VitaBench 'environment' in its source (load it with load_vitabench)")
    return task.source


# -------------------------------------------------------------------------------------------- tools
def _is_collection(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(x, dict) for x in v.values())


def _tool_plan(env: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """tool name -> (kind, environment key), kind in {"get_one", "search", "get_value"}."""
    plan: dict[str, tuple[str, str]] = {}
    for key, value in env.items():
        slug = _slug(str(key))
        if not slug:
            continue
        entries = [(f"get_{slug}", "get_one"), (f"search_{slug}", "search")] if _is_collection(value) \
            else [(f"get_{slug}", "get_value")]
        for name, kind in entries:
            if name in plan:
                raise EnvaceError(f"environment keys {plan[name][1]!r} and {key!r} both map to tool {name!r}")
            plan[name] = (kind, key)
    return plan


def _spec(name: str, kind: str, key: str) -> ToolSpec:
    if kind == "get_one":
        return ToolSpec(name=name, description=f"Get one record of '{key}' by its id (read-only).",
                        parameters={"type": "object", "properties": {
                            "id": {"type": "string", "description": f"the record's id (its key in '{key}')"}},
                            "required": ["id"], "additionalProperties": False})
    if kind == "search":
        return ToolSpec(name=name, description=(
            f"Search '{key}': records whose text contains every query word (case-insensitive); "
            "an empty query lists them (read-only)."),
            parameters={"type": "object", "properties": {
                "query": {"type": "string", "description": "words that must all appear"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50,
                          "description": f"maximum records returned (default {SEARCH_LIMIT})"}},
                "required": ["query"], "additionalProperties": False})
    return ToolSpec(name=name, description=f"Get '{key}' (read-only).",
                    parameters={"type": "object", "properties": {}, "additionalProperties": False})


def vita_tools(task: Task) -> list[ToolSpec]:
    """The generated read-only tools of `task` (rules: module docstring), in environment key order.

    Raises `EnvaceError` if the task has no VitaBench environment or two keys map to one tool name.
    """
    return [_spec(n, k, key) for n, (k, key) in _tool_plan(vita_source(task)["environment"]).items()]


def vita_policy(task: Task) -> str:
    """The agent's instructions for `task`: the current time and user id from the task's environment and
    a note that the tools are a generated read-only stand-in. No `evaluation_criteria` content."""
    env = vita_source(task)["environment"]
    lines = [f"You assist a user of a local-services platform ({vita_source(task)['domain']}).",
             "The tools read this task's database; they cannot place, change or cancel orders or reservations."]
    if env.get("time"):
        lines.append(f"Current time: {env['time']}.")
    if env.get("user_id"):
        lines.append(f"The user's id: {env['user_id']}.")
    return "\n".join(lines)


def vita_context(task: Task) -> TaskContext:
    """Everything a prompt may show about `task` (TaskContext: policy, tools, first user message)."""
    return TaskContext(task_id=task.id, domain=task.domain, policy=vita_policy(task), tools=vita_tools(task),
                       first_user_message=task.first_user_message)


def _search(records: Mapping[str, Any], query: str, limit: int) -> list[Any]:
    terms = query.lower().split()
    out = []
    for rid, rec in records.items():
        text = (str(rid) + " " + json.dumps(rec, ensure_ascii=False)).lower()
        if all(t in text for t in terms):
            out.append(rec)
            if len(out) >= limit:
                break
    return out


class VitaEnvironment(ToolEnvironment):
    """A private, read-only VitaBench environment over a deep copy of one task's `environment` database.

    `reset(task)` copies the task's database (two instances, or the task itself, never share state) and
    generates the task's tools (`vita_tools`). `step` executes a generated tool; unknown tools, invalid
    arguments and missing ids come back as `Observation(error=True)` with an "Error: ..." text. `snapshot` is
    the sha256 of the database's canonical JSON. `score` raises (module docstring: the official scorer is
    an LLM rubric judge; use `judge_reward` with a judge).
    """

    def __init__(self, domain: str | None = None):
        self.domain = domain or "vitabench"
        self._restrict = domain
        self.calls_made = 0
        self._task: Task | None = None
        self._db: dict[str, Any] | None = None
        self._plan: dict[str, tuple[str, str]] = {}
        self._tools: list[ToolSpec] = []

    def _need_reset(self) -> None:
        if self._db is None:
            raise EnvaceError("VitaEnvironment has no task: call reset(task) first")

    def tools(self) -> list[ToolSpec]:
        self._need_reset()
        return [t.model_copy(deep=True) for t in self._tools]

    def policy(self) -> str:
        self._need_reset()
        return vita_policy(self._task)

    def reset(self, task: Task) -> None:
        """Fresh private copy of `task`'s database. Raises `EnvaceError` for a task of another domain (when
        the environment was built for one) or without a VitaBench environment."""
        if self._restrict is not None and task.domain != self._restrict:
            raise EnvaceError(f"task {task.id!r} is of domain {task.domain!r}, environment is {self._restrict!r}")
        env = vita_source(task)["environment"]
        self._db = copy.deepcopy(env)
        self._plan = _tool_plan(self._db)
        self._tools = [_spec(n, k, key) for n, (k, key) in self._plan.items()]
        self._task = task
        self.domain = task.domain

    def step(self, call: ToolCall) -> Observation:
        """Execute `call` on the private database (counts in `calls_made`, whatever the outcome)."""
        self._need_reset()
        self.calls_made += 1
        if call.name not in self._plan:
            return Observation(content=f"Error: unknown tool {call.name!r}; tools: {sorted(self._plan)}", error=True)
        spec = next(t for t in self._tools if t.name == call.name)
        try:
            validate_arguments(call.arguments, spec)
        except InvalidArguments as e:
            return Observation(content=f"Error: {e}", error=True)
        kind, key = self._plan[call.name]
        value = self._db[key]
        if kind == "get_one":
            rid = call.arguments["id"]
            if rid not in value:
                return Observation(content=f"Error: no record {rid!r} in {key!r}", error=True)
            result = value[rid]
        elif kind == "search":
            result = _search(value, call.arguments["query"], int(call.arguments.get("limit", SEARCH_LIMIT)))
        else:
            result = value
        return Observation(content=json.dumps(result, ensure_ascii=False))

    def snapshot(self) -> str:
        self._need_reset()
        text = json.dumps(self._db, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def score(self, task: Task, steps: list[Step], final_message: str) -> RewardResult:
        raise EnvaceError(
            "VitaBench is scored by an LLM rubric judge (VitaBench TrajectoryEvaluator): the trajectory is read "
            f"in sliding windows of {WINDOW_SIZE} messages overlapping by {WINDOW_OVERLAP}, and the reward is 1 "
            "only when every rubric holds. That needs a judge model, which is not available offline: call "
            "envace_core.evaluation.vita.judge_reward(task, messages, judge) with a judge that returns "
            "per-rubric booleans.")
