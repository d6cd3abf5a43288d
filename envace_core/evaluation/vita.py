"""VitaBench adapter: its task files, a small read-only toolset over each task's database, the rubric-window
and reward arithmetic of its official judge, and its metrics avg@k / pass@k / pass^k.

Data: VitaBench (meituan-longcat/vitabench, MIT). Two domains' English task files ship in
`../shared/data/vitabench` (`delivery/tasks_en.json`, `instore/tasks_en.json`, 100 tasks each); the rest
(cross-domain, OTA) come from a user path in the same format. A task record has `id`, `domain`,
`message_history`, `environment` (the per-task database: `time`, `user_id`, `orders`, `stores` / `shops` /
..., `weather`, `location`, `user_historical_behaviors`), `user_scenario.user_profile`, `instructions` (the
user simulator's goal) and `evaluation_criteria` (`expected_states` with required/optional orders and
`state_rubrics`, and `overall_rubrics`).

Gold hygiene: `evaluation_criteria` is kept only in `Task.source` (scoring only). `first_user_message`,
`user_scenario`, `vita_policy`, `vita_tools` and `vita_context` are built from `instructions`,
`user_scenario`, and `environment` only.

Tools (NOT the official ones). VitaBench's 66 tools live in its code, which is not available offline, so
results with these tools are not comparable to published VitaBench numbers. `vita_tools(task)` generates a
small read-only toolset from the top-level keys of the task's `environment`:
  * a *collection* (a mapping whose values are all objects, keyed by id; an empty mapping counts too, e.g.
    `orders: {}`) `<c>` gives `get_<c>(id)` (the record under that key) and `search_<c>(query, limit=10)`
    (records whose JSON text contains every whitespace-separated query term, case-insensitive, in
    database order, at most `limit`; an empty query lists them);
  * any other key `<k>` (`time`, `user_id`, `weather`, `location`, `user_historical_behaviors`, ...) gives
    `get_<k>()` returning its value.
Tool names are the keys lower-cased with runs of other characters than [a-z0-9] replaced by "_". There
are no write tools (the official ones create/modify orders and reservations), so tasks whose rubrics need
an order placed cannot be completed with this toolset.

Scoring (official, not reproducible offline): an LLM judge reads the trajectory in sliding windows of 10
messages overlapping by 2 (`rubric_windows`); it starts with every rubric unmet and, window by window,
returns an updated verdict per rubric; the last verdict of each rubric stands; the task reward is 1 only
when every rubric is met; runs that end early (too many errors, max steps, invalid agent message) score 0
(`aggregate_rubric_verdicts`; VitaBench `src/vita/evaluator/evaluator_traj.py` TrajectoryEvaluator and
`src/vita/evaluator/evaluator.py`). `judge_reward` runs that loop with any judge callable that returns
per-rubric booleans. `VitaEnvironment.score` raises: there is no judge model offline.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.base import RewardResult, ToolEnvironment
from envace_core.roles import InvalidArguments, validate_arguments
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
        raise EnvaceError(f"no VitaBench task files named {pattern!r} under {p}")
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


def _record(task: Task) -> dict[str, Any]:
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
    return [_spec(n, k, key) for n, (k, key) in _tool_plan(_record(task)["environment"]).items()]


def vita_policy(task: Task) -> str:
    """The agent's instructions for `task`: the current time and user id from the task's environment and
    a note that the tools are a generated read-only stand-in. No `evaluation_criteria` content."""
    env = _record(task)["environment"]
    lines = [f"You assist a user of a local-services platform ({_record(task)['domain']}).",
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
        env = _record(task)["environment"]
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


# ---------------------------------------------------------------------------------- rubric scoring
def vita_rubrics(task: Task) -> list[str]:
    """The rubrics the official judge checks, in its order: every `state_rubrics` entry of
    `expected_states`, then `overall_rubrics`, each string once (first occurrence kept; VitaBench
    `TrajectoryEvaluator._initialize_rubric_states`). Scoring only: never put these in a prompt."""
    ec = _record(task).get("evaluation_criteria") or {}
    out: list[str] = []
    for st in ec.get("expected_states") or []:
        for r in (st or {}).get("state_rubrics") or []:
            if r not in out:
                out.append(r)
    for r in ec.get("overall_rubrics") or []:
        if r not in out:
            out.append(r)
    return out


def rubric_windows(messages: Sequence[Any], size: int = WINDOW_SIZE, overlap: int = WINDOW_OVERLAP) -> list[list[Any]]:
    """The judge's sliding windows over `messages` (VitaBench `TrajectoryEvaluator._create_sliding_windows`).

    With n = len(messages): if n <= size, one window holding all of them (also when n = 0). Otherwise
    windows start at 0, s, 2s, ... with stride s = size − overlap, each `messages[start:start + size]`,
    ending with the first window that reaches the last message. E.g. size 10, overlap 2, n = 19: [0:10],
    [8:18], [16:19]. Raises `EnvaceError` unless 0 <= overlap < size.
    """
    if not (isinstance(size, int) and isinstance(overlap, int) and 0 <= overlap < size):
        raise EnvaceError(f"rubric windows need integers 0 <= overlap < size, got size={size}, overlap={overlap}")
    msgs = list(messages)
    if len(msgs) <= size:
        return [msgs]
    out, i, step = [], 0, size - overlap
    while i < len(msgs):
        out.append(msgs[i:i + size])
        if i + size >= len(msgs):
            break
        i += step
    return out


def rubric_states(verdicts: Sequence[Mapping[int, bool] | Sequence[bool]], n_rubrics: int | None = None) -> list[bool]:
    """Final met/unmet state per rubric after the judge's window verdicts (VitaBench TrajectoryEvaluator).

    Every rubric starts unmet. `verdicts` has one entry per window, in order: a sequence of n booleans, or
    a mapping rubric index -> bool for the rubrics the judge returned (the others keep their state). Each
    verdict overwrites the state: the last verdict given for a rubric stands. `n_rubrics` is required when
    no entry is a full sequence. Raises `EnvaceError` on inconsistent lengths, indices out of range or
    non-boolean verdicts.
    """
    lengths = {len(v) for v in verdicts if not isinstance(v, Mapping)}
    if n_rubrics is None:
        if len(lengths) != 1:
            raise EnvaceError("give n_rubrics (the window verdicts do not fix the number of rubrics)")
        n_rubrics = lengths.pop()
    elif lengths - {n_rubrics}:
        raise EnvaceError(f"window verdict lengths {sorted(lengths)} differ from n_rubrics={n_rubrics}")
    states = [False] * n_rubrics
    for w, v in enumerate(verdicts):
        items = v.items() if isinstance(v, Mapping) else enumerate(v)
        for i, ok in items:
            if not isinstance(i, int) or not 0 <= i < n_rubrics:
                raise EnvaceError(f"window {w}: rubric index {i!r} out of range 0..{n_rubrics - 1}")
            if not isinstance(ok, bool):
                raise EnvaceError(f"window {w}: verdict for rubric {i} must be a bool, got {ok!r}")
            states[i] = ok
    return states


def aggregate_rubric_verdicts(verdicts: Sequence[Mapping[int, bool] | Sequence[bool]], n_rubrics: int | None = None,
                              terminated_early: bool = False) -> float:
    """VitaBench task reward from the judge's window verdicts: 1.0 when every rubric's final state
    (`rubric_states`) is met, else 0.0; 0.0 when the run ended early (too many errors, max steps, invalid
    agent message); 1.0 when the task has no rubric (VitaBench `evaluator.py` / `evaluator_traj.py`)."""
    if terminated_early:
        return 0.0
    if n_rubrics == 0:
        return 1.0
    states = rubric_states(verdicts, n_rubrics)
    return 1.0 if states and all(states) else 0.0


Judge = Callable[[list[Any], list[str], list[bool]], "Mapping[int, bool] | Sequence[bool]"]


def judge_reward(task: Task, messages: Sequence[Any], judge: Judge, terminated_early: bool = False,
                 size: int = WINDOW_SIZE, overlap: int = WINDOW_OVERLAP) -> dict[str, Any]:
    """Run the official sliding-window loop with a plug-in judge.

    `judge(window, rubrics, current_states)` sees one window of `messages`, the rubric texts
    (`vita_rubrics(task)`) and the current states, and returns per-rubric booleans (a list, or a mapping
    index -> bool for the rubrics it updates). Returns `{"reward", "rubric_score" (fraction met),
    "rubric_states", "num_windows"}`; with `terminated_early` the judge is not called and the reward is 0.
    """
    rubrics = vita_rubrics(task)
    if terminated_early:
        return {"reward": 0.0, "rubric_score": 0.0, "rubric_states": [False] * len(rubrics), "num_windows": 0}
    if not rubrics:
        return {"reward": 1.0, "rubric_score": 1.0, "rubric_states": [], "num_windows": 0}
    windows = rubric_windows(messages, size, overlap)
    verdicts: list[Any] = []
    states = [False] * len(rubrics)
    for w in windows:
        verdicts.append(judge(list(w), list(rubrics), list(states)))
        states = rubric_states(verdicts, len(rubrics))
    return {"reward": aggregate_rubric_verdicts(verdicts, len(rubrics)), "rubric_score": sum(states) / len(states),
            "rubric_states": states, "num_windows": len(windows)}


# ------------------------------------------------------------------------------------------ metrics
def _check_nck(n: int, c: int, k: int) -> None:
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise EnvaceError("n, c and k must be integers")
    if k < 1 or n < k or not 0 <= c <= n:
        raise EnvaceError(f"need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n trials with c successes: 1 − C(n−c, k) / C(n, k) (1 when n − c < k).

    Source: Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (arXiv:2107.03374), as used
    by VitaBench `metrics/agent_metrics.py`. Raises `EnvaceError` unless 1 <= k <= n and 0 <= c <= n.
    """
    _check_nck(n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k: the chance that k trials drawn without replacement from n (c successes) all succeed,
    C(c, k) / C(n, k). Source: Yao et al. 2024, "τ-bench" (arXiv:2406.12045), as used by VitaBench.
    Raises `EnvaceError` unless 1 <= k <= n and 0 <= c <= n."""
    _check_nck(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def avg_at_k(rewards: Sequence[float], k: int) -> float:
    """avg@k of one task as VitaBench computes it (`average_at_k`): the mean reward of its trials, which
    must number at least k. Raises `EnvaceError` for k < 1 or fewer than k trials."""
    if not isinstance(k, int) or k < 1 or len(rewards) < k:
        raise EnvaceError(f"avg@k needs 1 <= k <= number of trials, got k={k}, trials={len(rewards)}")
    return float(sum(rewards)) / len(rewards)


def vita_metrics(rewards_by_task: Mapping[str, Sequence[float]], ks: Sequence[int] | None = None) -> dict[str, Any]:
    """Benchmark-level metrics: per task, n = its trials, c = trials with reward exactly 1.0 (VitaBench
    `is_successful`); avg@k, pass@k, pass^k averaged over tasks. `ks` defaults to 1..min trials.

    Returns `{"avg_reward" (mean over all trials), "avg@k": {k: ..}, "pass@k": {k: ..}, "pass^k": {k: ..},
    "n_tasks"}`. Raises `EnvaceError` for no tasks, a task with no trials, or k above a task's trials.
    """
    if not rewards_by_task:
        raise EnvaceError("vita_metrics needs at least one task")
    if any(len(r) == 0 for r in rewards_by_task.values()):
        raise EnvaceError("every task needs at least one trial")
    min_n = min(len(r) for r in rewards_by_task.values())
    ks = list(ks) if ks is not None else list(range(1, min_n + 1))
    out: dict[str, Any] = {"n_tasks": len(rewards_by_task), "avg@k": {}, "pass@k": {}, "pass^k": {}}
    all_r = [float(x) for r in rewards_by_task.values() for x in r]
    out["avg_reward"] = sum(all_r) / len(all_r)
    T = len(rewards_by_task)
    for k in ks:
        out["avg@k"][k] = sum(avg_at_k(r, k) for r in rewards_by_task.values()) / T
        out["pass@k"][k] = sum(pass_at_k(len(r), sum(1 for x in r if x == 1.0), k) for r in rewards_by_task.values()) / T
        out["pass^k"][k] = sum(pass_hat_k(len(r), sum(1 for x in r if x == 1.0), k)
                               for r in rewards_by_task.values()) / T
    return out
