"""BFCL-v4 multi-turn tool classes behind our `ToolEnvironment`, and the one place bfcl-eval is imported.

The `bfcl-eval` package (installed `--no-deps`, METHOD.md §6) ships the data, the possible answers, the
executable multi-turn tool classes (`GorillaFileSystem`, `MathAPI`, `MessageAPI`, `TwitterAPI`,
`TicketAPI`, `TradingBot`, `TravelAPI`, `VehicleControlAPI` in
`bfcl_eval/eval_checker/multi_turn_eval/func_source_code/`) and the AST / multi-turn checkers. We use
them unchanged; `import_bfcl()` below is the only import path, so that the stand-in described there is
installed first.

`BfclMultiTurnEnv` runs one multi-turn entry: `reset` builds the entry's tool instances from its
`initial_config` with bfcl's own `execute_multi_turn_func_call` (which keeps instances in its module's
globals under `<model_name>_<entry id>_<class>_instance`; each env uses its own random model name, so two
envs never share an instance); `step` executes one call through the same utility; `snapshot` hashes the
instances' public state; `score` applies bfcl's `multi_turn_checker` to the calls recorded per turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import inspect
import json
import keyword
import os
import re
import sys
import types
import uuid
from collections.abc import Iterable
from functools import cache
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.base import RewardResult, ToolEnvironment
from envace_core.types import Observation, Step, Task, ToolCall, ToolSpec

#: The model name we give bfcl's checkers. Contains no "_" (bfcl maps "_" to "/" in model names).
BFCL_MODEL_NAME = "envace"

_STAND_IN_DOC = """Stand-in for `bfcl_eval.constants.model_config`, installed by envace (envs/bfcl.py).

Why: the real module imports every bfcl model handler (anthropic, openai, cohere, mistralai, google-genai,
boto3, tree-sitter, qwen-agent, vllm helpers, ...), whose pins clash with envace's dependencies (METHOD.md
§6: bfcl-eval is installed --no-deps). The checkers we use import only the name `MODEL_CONFIG_MAPPING`
from it: `ast_checker.convert_func_name` reads `MODEL_CONFIG_MAPPING[model_name].underscore_to_dot`
(only for function names containing "."), and `eval_runner_helper` imports it at module level (we call only
its `calculate_*_accuracy` functions, which do not touch it).

What it provides: `ModelConfig` (the same fields as bfcl's dataclass) and `MODEL_CONFIG_MAPPING` with a
single entry for envace's model name, `underscore_to_dot=False`: our tool calls keep bfcl's dotted
function names as they are, exactly what bfcl does for a model that supports "." in names. No handler,
price, or other behaviour is stubbed; a lookup of any other model name raises KeyError as in bfcl.
"""


def _install_model_config_stand_in() -> None:
    """Put the model-config stand-in (see `_STAND_IN_DOC`) into `sys.modules`; idempotent.

    If the real module was already imported (someone installed all handler dependencies), envace's entry
    is added to its `MODEL_CONFIG_MAPPING` instead.
    """
    name = "bfcl_eval.constants.model_config"
    existing = sys.modules.get(name)
    if existing is not None:
        mapping = getattr(existing, "MODEL_CONFIG_MAPPING", None)
        if isinstance(mapping, dict) and BFCL_MODEL_NAME not in mapping:
            mapping[BFCL_MODEL_NAME] = existing.ModelConfig(
                model_name=BFCL_MODEL_NAME, display_name=BFCL_MODEL_NAME, url="", org="", license="",
                model_handler="", is_fc_model=False, underscore_to_dot=False)
        return

    @dataclasses.dataclass
    class ModelConfig:
        model_name: str
        display_name: str
        url: str
        org: str
        license: str
        model_handler: Any
        input_price: float | None = None
        output_price: float | None = None
        is_fc_model: bool = True
        underscore_to_dot: bool = False

    mod = types.ModuleType(name, _STAND_IN_DOC)
    ModelConfig.__module__ = name
    mod.ModelConfig = ModelConfig
    mod.MODEL_CONFIG_MAPPING = {
        BFCL_MODEL_NAME: ModelConfig(model_name=BFCL_MODEL_NAME, display_name=BFCL_MODEL_NAME, url="", org="",
                                     license="", model_handler=None, is_fc_model=False,
                                     underscore_to_dot=False)}
    mod.__envace_stand_in__ = True
    sys.modules[name] = mod


@cache
def import_bfcl() -> types.SimpleNamespace:
    """Import the parts of bfcl-eval that envace uses, after installing the model-config stand-in.

    Also points `BFCL_PROJECT_ROOT` (bfcl creates `result/`, `score/` and `.file_locks/` there on import;
    its default is the venv's site-packages) at `$ENVACE_CACHE/bfcl` unless it is already set.

    Returns a namespace with: `load_dataset_entry`, `load_ground_truth_entry` (bfcl_eval.utils),
    `is_empty_output`, `is_function_calling_format_output` (bfcl_eval.utils), `ast_checker`, `Language`,
    `multi_turn_checker`, `execute_multi_turn_func_call`, `is_empty_execute_response`,
    `calculate_weighted_accuracy`, `calculate_unweighted_accuracy`, `calculate_percentage_weighted_accuracy`
    (bfcl_eval/eval_checker/eval_runner_helper.py), `MAXIMUM_STEP_LIMIT`, `PROMPT_STYLE_TEMPLATES`,
    `DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING`, `GORILLA_TO_OPENAPI`, category lists and
    `MULTI_TURN_FUNC_DOC_PATH` / `MULTI_TURN_FUNC_DOC_FILE_MAPPING`.

    Raises `EnvaceError` when bfcl-eval is not installed.
    """
    from envace_core.store.files import cache_root

    os.environ.setdefault("BFCL_PROJECT_ROOT", str(cache_root() / "bfcl"))
    _install_model_config_stand_in()
    try:
        from bfcl_eval.constants import category_mapping as cm
        from bfcl_eval.constants.default_prompts import (
            DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
            MAXIMUM_STEP_LIMIT,
            PROMPT_STYLE_TEMPLATES,
        )
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.constants.eval_config import MULTI_TURN_FUNC_DOC_PATH
        from bfcl_eval.constants.executable_backend_config import (
            MULTI_TURN_FUNC_DOC_FILE_MAPPING,
            STATELESS_CLASSES,
        )
        from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
        from bfcl_eval.eval_checker.eval_runner_helper import (
            calculate_percentage_weighted_accuracy,
            calculate_unweighted_accuracy,
            calculate_weighted_accuracy,
        )
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
            multi_turn_checker,
        )
        from bfcl_eval.utils import (
            is_empty_output,
            is_function_calling_format_output,
            load_dataset_entry,
            load_file,
            load_ground_truth_entry,
        )
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EnvaceError(f"bfcl-eval is needed for BFCL (pip install --no-deps bfcl-eval): {e}") from e
    return types.SimpleNamespace(
        category_mapping=cm, Language=Language, ast_checker=ast_checker,
        multi_turn_checker=multi_turn_checker, multi_turn_utils=multi_turn_utils,
        execute_multi_turn_func_call=multi_turn_utils.execute_multi_turn_func_call,
        is_empty_execute_response=multi_turn_utils.is_empty_execute_response,
        calculate_weighted_accuracy=calculate_weighted_accuracy,
        calculate_unweighted_accuracy=calculate_unweighted_accuracy,
        calculate_percentage_weighted_accuracy=calculate_percentage_weighted_accuracy,
        is_empty_output=is_empty_output, is_function_calling_format_output=is_function_calling_format_output,
        load_dataset_entry=load_dataset_entry, load_ground_truth_entry=load_ground_truth_entry, load_file=load_file,
        MAXIMUM_STEP_LIMIT=MAXIMUM_STEP_LIMIT, PROMPT_STYLE_TEMPLATES=PROMPT_STYLE_TEMPLATES,
        DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING=DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
        GORILLA_TO_OPENAPI=GORILLA_TO_OPENAPI, MULTI_TURN_FUNC_DOC_PATH=MULTI_TURN_FUNC_DOC_PATH,
        MULTI_TURN_FUNC_DOC_FILE_MAPPING=MULTI_TURN_FUNC_DOC_FILE_MAPPING, STATELESS_CLASSES=STATELESS_CLASSES,
    )


# ------------------------------------------------------------------------------------ tool schemas
def _json_schema(node: Any, mapping: dict[str, str]) -> Any:
    if isinstance(node, list):
        return [_json_schema(x, mapping) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str):
            out[key] = mapping.get(value, "string")
        elif key == "optional":  # bfcl's marker; JSON schema expresses it with `required`
            continue
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _json_schema(sub, mapping) for name, sub in value.items()}
        else:
            out[key] = _json_schema(value, mapping)
    return out


def bfcl_tool_spec(function: dict) -> ToolSpec:
    """A bfcl function doc (`name`, `description`, `parameters` in bfcl's types) as our `ToolSpec`.

    Types are mapped with bfcl's own `GORILLA_TO_OPENAPI` (dict->object, float->number, tuple->array,
    any->string, ...), recursively; bfcl's `optional` markers are dropped (`required` says it). Display
    and prompts only: the AST checker always receives bfcl's original doc.
    """
    mapping = import_bfcl().GORILLA_TO_OPENAPI
    params = _json_schema(function.get("parameters") or {"type": "dict", "properties": {}}, mapping)
    params.setdefault("type", "object")
    return ToolSpec(name=function["name"], description=function.get("description", ""), parameters=params)


# ------------------------------------------------------------------------------------------- state
def _canonical(obj: Any, path: tuple[int, ...] = ()) -> Any:
    """A JSON-able, deterministic view of a tool instance's public state (cycles become "<cycle>")."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, (datetime.datetime, datetime.date, datetime.time, datetime.timedelta)):
        return str(obj)
    if id(obj) in path:
        return "<cycle>"
    path = path + (id(obj),)
    if isinstance(obj, dict):
        return {"__dict__": sorted(([json.dumps(_canonical(k, path), sort_keys=True), _canonical(v, path)]
                                    for k, v in obj.items()), key=lambda kv: kv[0])}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v, path) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((_canonical(v, path) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
    if hasattr(obj, "__dict__"):
        return {"__class__": type(obj).__name__,
                **{k: _canonical(v, path) for k, v in sorted(vars(obj).items()) if not k.startswith("_")}}
    return repr(obj)


def instances_hash(instances: dict[str, Any]) -> str:
    """sha256 of the public (non-underscore) attributes of bfcl tool instances, by class name.

    The same attributes bfcl's `state_checker` compares (`vars(instance)` without `_`-prefixed keys).
    """
    view = {name: _canonical(inst) for name, inst in sorted(instances.items())}
    return hashlib.sha256(json.dumps(view, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


# ------------------------------------------------------------------------------- call <-> bfcl string
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class UnsafeCall(EnvaceError):
    """A call whose name or argument names cannot be rendered as a plain Python call expression."""


def call_string(name: str, arguments: dict[str, Any]) -> str:
    """`name(k1=repr(v1), k2=repr(v2))`: the form bfcl's executor and multi-turn checker take.

    The same rendering as bfcl's `decoded_output_to_execution_list` for literal values. The name must be a
    (dotted) identifier and every argument name an identifier, so the string is a single call expression;
    values are Python literals by `repr`. Raises `UnsafeCall` otherwise.
    """
    if not isinstance(name, str) or not _IDENT.match(name) or any(keyword.iskeyword(p) for p in name.split(".")):
        raise UnsafeCall(f"function name {name!r} is not an identifier")
    if not isinstance(arguments, dict):
        raise UnsafeCall(f"arguments of {name} must be a mapping")
    for k in arguments:
        if not isinstance(k, str) or not k.isidentifier() or keyword.iskeyword(k):
            raise UnsafeCall(f"argument name {k!r} of {name} is not an identifier")
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in arguments.items()) + ")"


# -------------------------------------------------------------------------------------------- env
_POLICY = ("BFCL multi-turn: complete each user request with the given functions, calling as many as needed "
           "across steps; when no more calls are needed, reply in text and the next request follows.")


def multi_turn_function_docs(involved_classes: Iterable[str]) -> list[dict]:
    """bfcl's function docs of the involved classes (all functions, including miss_func holdouts)."""
    b = import_bfcl()
    docs: list[dict] = []
    for cls in involved_classes:
        docs += b.load_file(b.MULTI_TURN_FUNC_DOC_PATH / b.MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls])
    return docs


def drop_instances(model_name: str) -> int:
    """Delete bfcl's cached tool instances created under `model_name` (also `_eval` / ground-truth ones).

    bfcl's `execute_multi_turn_func_call` keeps instances in its module globals forever; every envace
    user of it (env, checker) uses a random model name and drops its instances when done.
    """
    g = vars(import_bfcl().multi_turn_utils)
    prefix = re.sub(r"[-./:]", "_", model_name) + "_"
    gone = [k for k in g if k.startswith(prefix) and k.endswith("_instance")]
    for k in gone:
        del g[k]
    return len(gone)


class BfclMultiTurnEnv(ToolEnvironment):
    """One BFCL multi-turn entry on bfcl's own tool classes (state private to this instance).

    Use: `reset(task)` (a task from `evaluation.bfcl.bfcl_task`), then per user turn `begin_turn()` and
    `step(call)` / `step_calls(calls)` (one model step), then `score(task, ...)`. `turn_calls` holds, per
    turn, per step, the bfcl call strings executed: exactly the `multi_turn_model_result_list_decoded`
    that bfcl's checker takes.
    """

    domain = "bfcl"

    def __init__(self) -> None:
        self._model_name = f"envace_env_{uuid.uuid4().hex}"
        self._entry: dict | None = None
        self._instances: dict[str, Any] = {}
        self._methods: set[str] = set()
        self._tools: list[ToolSpec] = []
        self._holdout: dict[str, list[dict]] = {}
        self.turn_calls: list[list[list[str]]] = []
        self.calls_made = 0

    # -- ToolEnvironment
    def tools(self) -> list[ToolSpec]:
        """The tools visible now: the entry's functions, plus holdouts revealed by `begin_turn`."""
        return list(self._tools)

    def policy(self) -> str:
        return _POLICY

    def _long_context(self) -> bool:
        cat = self._entry["id"].rsplit("_", 1)[0] if self._entry else ""
        return "long_context" in cat or "composite" in cat

    def reset(self, task: Task) -> None:
        """Fresh instances of the entry's `involved_classes`, loaded from (a deep copy of) its `initial_config`.

        Raises `EnvaceError` when `task.source` has no bfcl multi-turn entry.
        """
        entry = (task.source or {}).get("entry")
        if not isinstance(entry, dict) or "involved_classes" not in entry:
            raise EnvaceError(f"task {task.id} is not a BFCL multi-turn task (source['entry'] missing)")
        self.close()
        self._model_name = f"envace_env_{uuid.uuid4().hex}"
        self._entry = entry
        b = import_bfcl()
        _, self._instances = b.execute_multi_turn_func_call(
            [], entry.get("initial_config", {}), entry["involved_classes"], self._model_name, entry["id"],
            long_context=self._long_context(), is_evaL_run=False)
        self._methods = {name for inst in self._instances.values()
                         for name, _ in inspect.getmembers(inst, predicate=inspect.ismethod)
                         if not name.startswith("_")}
        functions = entry.get("function") or multi_turn_function_docs(entry["involved_classes"])
        self._tools = [bfcl_tool_spec(f) for f in functions]
        self._holdout = {str(k): list(v) for k, v in (entry.get("missed_function") or {}).items()}
        self.turn_calls = []

    def begin_turn(self) -> list[dict]:
        """Start the next user turn; returns the holdout function docs revealed at this turn (miss_func)."""
        if self._entry is None:
            raise EnvaceError("reset() the environment before begin_turn()")
        revealed = self._holdout.get(str(len(self.turn_calls)), [])
        self._tools += [bfcl_tool_spec(f) for f in revealed]
        self.turn_calls.append([])
        return revealed

    def step(self, call: ToolCall) -> Observation:
        """Execute one call (one model step of one call)."""
        return self.step_calls([call])[0]

    def step_calls(self, calls: list[ToolCall]) -> list[Observation]:
        """Execute one model step's calls in order with bfcl's `execute_multi_turn_func_call`.

        A call naming no method of the involved classes, or not renderable as a call (`UnsafeCall`), is not
        executed: its observation is an error and it is not recorded. Executed calls are recorded as one
        step of the current turn (a turn is opened if none is). bfcl's executor returns each result as a
        string; an error is `"Error during execution: ..."` or a JSON object with an "error" key.
        """
        if self._entry is None:
            raise EnvaceError("reset() the environment before step()")
        if not self.turn_calls:
            self.turn_calls.append([])
        obs: list[Observation | None] = []
        strings: list[str] = []
        for call in calls:
            if call.name not in self._methods:
                obs.append(Observation(content=json.dumps({"error": f"No such function: {call.name}"}), error=True))
                continue
            try:
                strings.append(call_string(call.name, call.arguments))
                obs.append(None)
            except UnsafeCall as e:
                obs.append(Observation(content=json.dumps({"error": str(e)}), error=True))
        if strings:
            b = import_bfcl()
            results, _ = b.execute_multi_turn_func_call(
                strings, self._entry.get("initial_config", {}), self._entry["involved_classes"], self._model_name,
                self._entry["id"], long_context=self._long_context(), is_evaL_run=False)
            self.calls_made += len(strings)
            self.turn_calls[-1].append(strings)
            it = iter(results)
            obs = [o if o is not None else _observation(next(it)) for o in obs]
        return [o for o in obs if o is not None]

    def snapshot(self) -> str:
        """sha256 of the instances' public state (`instances_hash`)."""
        return instances_hash(self._instances)

    def score(self, task: Task, steps: list[Step], final_message: str) -> RewardResult:
        """bfcl's `multi_turn_checker` on `turn_calls` against `task.source["ground_truth"]`.

        `steps` and `final_message` are not used: the checker needs the per-turn grouping, which this env
        records itself. Fewer recorded turns than ground-truth turns fails as bfcl's
        `multi_turn:force_terminated`. reward 1.0 when valid, else 0.0; `info` is the checker's result.
        """
        result = check_multi_turn(task.source["entry"], self.turn_calls, task.source["ground_truth"])
        return RewardResult(reward=1.0 if result["valid"] else 0.0, info=result)

    def close(self) -> None:
        """Drop this env's instances from bfcl's executor globals."""
        if self._entry is not None:
            drop_instances(self._model_name)
        self._instances = {}

    def __del__(self):  # best effort; bfcl would otherwise keep every instance alive
        with contextlib.suppress(Exception):
            self.close()


def _observation(result: str) -> Observation:
    error = result.startswith("Error during execution")
    if not error:
        try:
            value = json.loads(result)
            error = isinstance(value, dict) and bool(value.get("error"))
        except ValueError:
            pass
    return Observation(content=result, error=error)


def check_multi_turn(entry: dict, turn_calls: list[list[list[str]]], ground_truth: list[list[str]]) -> dict:
    """Apply bfcl's `multi_turn_checker` (bfcl_eval/eval_checker/multi_turn_eval/multi_turn_checker.py).

    Mirrors bfcl's `_evaluate_single_multi_turn_entry` (eval_runner.py): a model result with a different
    number of turns than the ground truth is invalid (`multi_turn:force_terminated`), empty steps are
    skipped; then the checker re-executes the model's and the ground truth's calls from `initial_config`
    and compares state and responses turn by turn. Runs under a fresh model name; its instances are dropped
    afterwards. Returns the checker's dict (`valid`, and `error_type` / `error_message` when invalid).
    """
    if len(turn_calls) != len(ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error_message": f"model result has {len(turn_calls)} turns, the ground truth {len(ground_truth)}"}
    b = import_bfcl()
    decoded = [[step for step in turn if not b.is_empty_execute_response(step)] for turn in turn_calls]
    name = f"envace_check_{uuid.uuid4().hex}"
    try:
        result = b.multi_turn_checker(decoded, ground_truth, entry, entry["id"].rsplit("_", 1)[0], name)
    finally:
        drop_instances(name)
    return result
