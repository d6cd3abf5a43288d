"""Tool learning inputs and the pipeline switches it needs (METHOD.md §5).

`tool_learning.load_tools` / `load_examples` reject bad schemas and examples naming the exact field;
`data.hidden_tools` makes curate drop train tasks that call a hidden tool and hide it from every
prompt; `train.init_adapter` starts training from a given adapter's weights; `reward.replay_fidelity
=false` makes scoring call no environment; the dataset gate accepts calls of a task's added tools.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.tool_learning.inputs import (
    NewTool,
    ToolSchemaError,
    load_examples,
    load_tools,
)


def _tool(name="refund_order", **fn):
    params = {"type": "object", "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
              "required": ["order_id", "amount"]}
    return {"type": "function", "function": {"name": name, "description": "Refund part of an order.",
                                             "parameters": params, **fn}}


def _write(tmp_path, obj, name="tools.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def _error(tmp_path, tools) -> str:
    with pytest.raises(ToolSchemaError) as e:
        load_tools(_write(tmp_path, tools))
    return str(e.value)


# ------------------------------------------------------------------------------------ tool schemas
def test_good_openai_and_bare_formats_load(tmp_path):
    wrapped = load_tools(_write(tmp_path, {"tools": [_tool(), _tool("lookup")]}))
    assert [t.spec.name for t in wrapped] == ["refund_order", "lookup"]
    assert wrapped[0].spec.parameters["required"] == ["order_id", "amount"]
    assert wrapped[0].doc == "Refund part of an order." and wrapped[0].implementation is None

    bare = dict(_tool()["function"], documentation="Long docs.", implementation="json:dumps")
    (tool,) = load_tools([bare])
    assert isinstance(tool, NewTool) and tool.doc == "Long docs."
    assert tool.spec.description == "Refund part of an order."
    assert tool.load_implementation() is json.dumps


@pytest.mark.parametrize("mutate, field, words", [
    (lambda t: t["function"].pop("name"), "tools[1].function.name", "required field is missing"),
    (lambda t: t["function"].update(name="refund order!"), "tools[1].function.name", "does not match"),
    (lambda t: t["function"]["parameters"].update(type="array"), "tools[1].function.parameters.type",
     "'object' was expected"),
    (lambda t: t["function"]["parameters"]["required"].append("reason"),
     "tools[1].function.parameters.required[2]", "'reason' is not in parameters.properties"),
    (lambda t: t["function"]["parameters"]["properties"]["amount"].update(type="money"),
     "tools[1].function.parameters.properties.amount.type", "is not valid under any of the given schemas"),
    (lambda t: t["function"]["parameters"]["properties"]["amount"].update(minimum="zero"),
     "tools[1].function.parameters.properties.amount.minimum", "is not of type 'number'"),
    (lambda t: t["function"].update(paramters={}), "tools[1].function.paramters", "unknown field"),
    (lambda t: t.update(type="tool"), "tools[1].type", "'function' was expected"),
    (lambda t: t["function"].update(description=""), "tools[1].function.description", "non-empty"),
])
def test_bad_schema_names_the_exact_field(tmp_path, mutate, field, words):
    bad = _tool("lookup")
    mutate(bad)
    msg = _error(tmp_path, [_tool(), bad])
    assert msg.startswith(f"{tmp_path / 'tools.json'}: {field}: ") and words in msg, msg
    assert "tools[0]" not in msg  # the good tool is not blamed


def test_duplicate_tool_and_every_problem_reported(tmp_path):
    msg = _error(tmp_path, [_tool(), _tool(), {"name": "x"}])
    assert "tools[1].function.name: duplicate tool name 'refund_order' (also tools[0].function.name)" in msg
    assert "tools[2].description: required field is missing" in msg
    assert "tools[2].parameters: required field is missing" in msg


def test_file_that_is_not_json_gives_line_and_column(tmp_path):
    msg = _error(tmp_path, '[\n  {"type": "function",,}\n]')
    assert "tools.json: line 2, column 23: not valid JSON" in msg


def test_missing_file_empty_list_and_wrong_top_level(tmp_path):
    with pytest.raises(ToolSchemaError, match="absent.json: no such file"):
        load_tools(tmp_path / "absent.json")
    (tmp_path / "a_folder").mkdir()
    with pytest.raises(ToolSchemaError, match="a_folder: a folder, not a file"):
        load_tools(tmp_path / "a_folder")
    assert "the list is empty" in _error(tmp_path, [])
    assert "expected a list of tools" in _error(tmp_path, {"function": {}})
    assert "extra: unknown top-level field" in _error(tmp_path, {"tools": [_tool()], "extra": 1})


# ---------------------------------------------------------------------------------------- examples
def _examples(tmp_path, lines):
    return _write(tmp_path, "\n".join(lines) + "\n", "ex.jsonl")


def test_good_examples_load(tmp_path):
    tools = load_tools([_tool()])
    path = _examples(tmp_path, [json.dumps({"tool": "refund_order", "arguments": {"order_id": "#W1", "amount": 5},
                                            "result": {"refunded": 5.0}}), "",
                                json.dumps({"tool": "refund_order", "arguments": {"order_id": "#W2", "amount": 1.5},
                                            "result": "Error: order not delivered"})])
    ex = load_examples(path, tools)
    assert [(e.call.name, e.call.arguments["order_id"], e.result) for e in ex] == [
        ("refund_order", "#W1", {"refunded": 5.0}), ("refund_order", "#W2", "Error: order not delivered")]


def test_bad_examples_name_line_and_field(tmp_path):
    tools = load_tools([_tool(), _tool("lookup")])
    path = _examples(tmp_path, [
        json.dumps({"tool": "refund_order", "arguments": {"order_id": "#W1", "amount": 5}, "result": 1}),
        json.dumps({"tool": "refund_order", "arguments": {"order_id": "#W1", "amount": "ten"}, "result": 1}),
        json.dumps({"tool": "refund", "arguments": {}, "result": 1}),
        json.dumps({"tool": "lookup", "arguments": {"order_id": "#W1"}}),
        '{"tool": "lookup", "arguments": {}, "result": not json}',
    ])
    with pytest.raises(ToolSchemaError) as e:
        load_examples(path, tools)
    msg, f = str(e.value), str(path)
    assert f"{f}:1" not in msg
    assert f"{f}:2: arguments.amount: 'ten' is not of type 'number'" in msg
    assert f"{f}:3: tool: unknown tool 'refund'; known tools: lookup, refund_order" in msg
    assert f"{f}:4: result: required field is missing" in msg
    assert f"{f}:4: arguments: 'amount' is a required property" in msg
    assert f"{f}:5: column 47: not valid JSON" in msg
    assert len(e.value.errors) == 5


def test_references_must_resolve_inside_the_schema_and_implementations_must_import(tmp_path):
    remote = _tool("lookup")
    remote["function"]["parameters"]["properties"]["zip"] = {"$ref": "http://example.com/zip.json"}
    msg = _error(tmp_path, [_tool(), remote])
    assert "tools[1].function.parameters.properties.zip[\"$ref\"]: 'http://example.com/zip.json': only references " \
           "inside the schema" in msg
    dangling = _tool("lookup")
    dangling["function"]["parameters"]["properties"]["zip"] = {"$ref": "#/$defs/Missing"}
    assert "'#/$defs/Missing' does not resolve" in _error(tmp_path, [dangling])
    local = _tool("lookup")
    local["function"]["parameters"].update({"$defs": {"Zip": {"type": "string"}}})
    local["function"]["parameters"]["properties"]["zip"] = {"$ref": "#/$defs/Zip"}
    (tool,) = load_tools([local])
    assert load_examples(_examples(tmp_path, [json.dumps({"tool": "lookup", "arguments": {
        "order_id": "#W1", "amount": 1, "zip": "02139"}, "result": 1})]), [tool])
    broken = dict(_tool()["function"], implementation="no_such_pkg.mod:fn")
    assert "tools[0].implementation: cannot import 'no_such_pkg.mod:fn'" in _error(tmp_path, [broken])


def test_examples_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "ex.jsonl"
    path.write_bytes('{"tool": "refund_order", "arguments": {"order_id": "caf\u00e9"}, "result": 1}'.encode("latin-1"))
    with pytest.raises(ToolSchemaError, match="not UTF-8 text"):
        load_examples(path, load_tools([_tool()]))


# ------------------------------------------------------------------------- hidden tools in curate
HIDDEN = "get_reservation_details"


def test_unknown_hidden_tool_is_a_config_error_listing_the_tools():
    from envace_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"hidden_tools \['get_reservation'\].*airline: .*get_reservation_details"):
        load_config("test", {"data": {"hidden_tools": ["get_reservation"]}})


def test_curate_drops_train_tasks_calling_a_hidden_tool_and_hides_it(tmp_path, monkeypatch, capsys):
    from envace_core.config import load_config
    from envace_core.envs.tau2.tasks import load_tasks, task_context
    from envace_core.stages.curate import curate
    from envace_core.stages.dataset import load_dataset

    monkeypatch.chdir(tmp_path)
    cfg = load_config("test", {"data": {"hidden_tools": [HIDDEN], "max_train_tasks_per_domain": 3},
                               "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "reg")}})
    ds = curate(cfg)
    full = load_tasks("airline", "train")
    calls = [t for t in full if any(a.name == HIDDEN for a in t.gold_actions)]
    want = [t.id for t in full if t not in calls][:3]
    train, test = load_dataset(ds, "train"), load_dataset(ds, "test")
    assert [t.id for t in train] == want and len(calls) > 0
    assert f"dropped {len(calls)} train task(s)" in capsys.readouterr().out
    for t in train + test:
        assert t.tools_hidden == [HIDDEN]
        names = [s.name for s in task_context(t).tools]
        assert HIDDEN not in names and "get_user_details" in names
    assert any(a.name == HIDDEN for a in test[0].gold_actions)  # test tasks keep their gold


# ------------------------------------------------------------------------------ dataset gate
def test_dataset_gate_accepts_calls_of_added_tools_only_with_valid_schemas():
    from envace_core.stages.dataset import task_record
    from envace_core.stages.gates import dataset_gate
    from envace_core.types import Task, ToolCall, ToolSpec

    spec = ToolSpec(**_tool()["function"])
    call = ToolCall(name="refund_order", arguments={"order_id": "#W1", "amount": 5})

    def frame(added, args=call.arguments):
        tasks = [Task(id="retail/x", domain="retail", split="train", first_user_message="hi",
                      gold_actions=[call.model_copy(update={"arguments": args})], tools_added=added),
                 Task(id="retail/y", domain="retail", split="test", first_user_message="hi")]
        return pd.DataFrame([task_record(t) for t in tasks])

    check = "gold actions are valid calls of valid tool schemas"
    assert dataset_gate(frame([spec]), []).checks[check]
    assert not dataset_gate(frame([]), []).checks[check]  # not a retail tool without tools_added
    assert not dataset_gate(frame([spec], {"order_id": "#W1"}), []).checks[check]  # args break the schema
    broken = spec.model_copy(update={"parameters": {"type": "object", "properties": {"a": {"type": "money"}}}})
    assert not dataset_gate(frame([broken]), []).checks[check]


# -------------------------------------------------------------------------- replay_fidelity=false
def test_replay_fidelity_false_makes_no_environment_call(monkeypatch):
    import envace_core.training.rollout as rollout_mod
    from envace_core.config import load_config
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.training.policy import rollout_params
    from envace_core.training.rollout import training_group
    from envace_core.types import Observation, Step, Trajectory

    task = next(t for t in load_tasks("airline", "train") if t.gold_actions)
    steps = [Step(action=a, observation=Observation(content="{}")) for a in task.gold_actions]
    monkeypatch.setattr(rollout_mod, 'rehearsal_rollouts', lambda engine, ctx, G, p, **kw: [
        Trajectory(task_id=task.id, group_index=i, steps=[s.model_copy() for s in steps] + [Step(message="done")],
                   termination="agent_message") for i in range(G)])
    calls = []
    real_step = Tau2Environment.step
    monkeypatch.setattr(Tau2Environment, "step", lambda self, call: calls.append(call) or real_step(self, call))

    def group(replay_fidelity):
        cfg = load_config("test", {"reward": {"name": "actions", "replay_fidelity": replay_fidelity}})
        calls.clear()
        trajs = training_group(None, task, cfg, rollout_params(cfg), seed=0)
        return trajs, len(calls)

    trajs, n = group(False)
    assert n == 0 and all(t.reward == 1.0 for t in trajs)
    assert all(s.real_observation is None and s.fidelity is None for t in trajs for s in t.steps)
    trajs, n = group(True)  # the default replays every call of every trajectory to log fidelity
    assert n == len(trajs) * len(steps) and trajs[0].steps[0].fidelity is not None


# ----------------------------------------------------------------------------- init_adapter
def _lora(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_" in k}


@pytest.fixture(scope="module")
def parent_adapter(tiny_model_dir, tmp_path_factory):
    """A saved adapter whose LoRA weights are random (a fresh LoRA has B = 0)."""
    from tests.test_trainer import make_trainer

    trainer = make_trainer(tiny_model_dir, lora_b_seed=5)
    out = tmp_path_factory.mktemp("parent") / "adapter"
    trainer.save_adapter(str(out))
    return out, _lora(trainer)


def test_training_starts_from_init_adapter_and_a_checkpoint_wins(tiny_model_dir, parent_adapter, tmp_path,
                                                                 monkeypatch, capsys):
    from envace_core.config import load_config
    from envace_core.stages.curate import curate
    from envace_core.stages.train import rollout_and_train
    from envace_core.training.trainer import PolicyTrainer

    adapter, weights = parent_adapter
    monkeypatch.chdir(tmp_path)
    cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                               "train": {"init_adapter": str(adapter)},
                               "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "reg")}})
    ds = curate(cfg)
    seen, loads = [], []
    real_update, real_load = PolicyTrainer.update, PolicyTrainer.load_adapter
    monkeypatch.setattr(PolicyTrainer, "update", lambda self, rows: seen.append(_lora(self)) or real_update(self, rows))
    monkeypatch.setattr(PolicyTrainer, "load_adapter", lambda self, d: loads.append(d) or real_load(self, d))
    rollout_and_train(cfg, ds)
    assert len(seen) == 1 and seen[0].keys() == weights.keys()
    assert all(seen[0][k].equal(weights[k]) for k in weights)  # the first update starts from the parent
    assert any(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)  # not a fresh LoRA
    rollout_and_train(cfg, ds)  # same command again: resumes the checkpoint, no reload
    assert len(loads) == 1 and "resuming run" in capsys.readouterr().out


def test_init_adapter_errors_and_run_id(tiny_model_dir, parent_adapter, tmp_path):
    from envace_core import EnvaceError
    from envace_core.config import load_config
    from envace_core.store.uri import init_adapter_dir
    from envace_core.training.loop import load_init_adapter, training_run_id
    from envace_core.training.trainer import AdapterLoadError
    from tests.test_trainer import make_trainer

    adapter, _ = parent_adapter
    with pytest.raises(AdapterLoadError, match=r"train.init_adapter=.*\(r, alpha, target_modules\).*lora_r"):
        load_init_adapter(make_trainer(tiny_model_dir, lora_r=4), str(adapter))
    with pytest.raises(AdapterLoadError, match=r"train.init_adapter=.*act.*missing"):
        load_init_adapter(make_trainer(tiny_model_dir, policy_per_role=True), str(adapter))
    with pytest.raises(EnvaceError, match="is not a directory"):
        init_adapter_dir(str(tmp_path / "absent"))

    copy = tmp_path / "copy"
    copy.mkdir()
    for f in adapter.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    cfg = load_config("test", {"train": {"init_adapter": str(copy)}})
    ds = {"version": "v"}
    first = training_run_id(cfg, ds)
    (copy / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes()[:-1] + b"x")
    assert training_run_id(cfg, ds) != first  # other weights, same path: another run


def test_init_adapter_from_an_s3_registry_version(parent_adapter, s3_server, tmp_path):
    import shutil

    from envace_core import EnvaceError
    from envace_core.store.uri import init_adapter_dir, open_store

    adapter, _ = parent_adapter
    shutil.copytree(adapter, tmp_path / "version" / "artifacts" / "adapter")
    open_store(f"{s3_server.root}/registry").put_dir(tmp_path / "version", "policy/v1")
    got = init_adapter_dir(f"{s3_server.root}/registry/policy/v1/artifacts/adapter")
    assert (got / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
    with pytest.raises(EnvaceError, match="no committed artifact directory"):
        init_adapter_dir(f"{s3_server.root}/registry/policy/v2/artifacts/adapter")


def test_an_oversized_description_or_documentation_is_named_with_its_length_not_quoted(tmp_path):
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look up a thing.",
                                             "parameters": {"type": "object", "properties": {}}}}
    msg = _error(tmp_path, [{**tool, "documentation": "x" * 50_000}])
    assert "tools[0].documentation: 50000 characters, too long (at most 16000 characters" in msg
    assert "xxxx" not in msg  # jsonschema's own message quotes the whole text
    long_desc = {**tool, "function": {**tool["function"], "description": "d" * 5000}}
    assert "tools[0].function.description: 5000 characters, too long" in _error(tmp_path, [long_desc])
