"""Tool learning: the adaptation-task builder, the rehearsal-only adaptation run with its
lineage, and the before/after measurement, on tau2 retail with the tiny model."""

from __future__ import annotations

import hashlib
import json

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
import envace_core.envs.tau2.synth as synth_mod
import envace_core.models as models_mod
import envace_core.tool_learning.inputs as inputs
import envace_core.tool_learning.tasks as tasks
import envace_core.training.policy as policy_mod
import envace_core.types as types_mod
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.synth import domain_env
from envace_core.envs.tau2.tasks import domain_static, load_tasks
from envace_core.stages.dataset import load_dataset
from envace_core.tool_learning.adapt import RealCallGuard, adapt
from envace_core.tool_learning.inputs import ToolExample, load_tools
from envace_core.tool_learning.measure import measure
from envace_core.tool_learning.tasks import (
    AdaptationError,
    adaptation_gate,
    build_adaptation_tasks,
    examples_sha256,
    implementation_of,
    tool_schema_sha256,
)
from envace_core.types import ToolCall

TOOL = "find_user_id_by_name_zip"
# Made-up people: in no tau2 DB, so no test-split user can hide in them.
PEOPLE = [("Ada", "Lovelace", "10001", "ada_lovelace_1815"), ("Alan", "Turing", "20002", "alan_turing_1912"),
          ("Grace", "Hopper", "30003", "grace_hopper_1906")]


def _retail_tool():
    spec = next(t for t in domain_static("retail")[0] if t.name == TOOL)
    return load_tools([spec.openai_schema()])


def _examples(name: str = TOOL) -> list[ToolExample]:
    return [ToolExample(call=ToolCall(name=name, arguments={"first_name": f, "last_name": la, "zip": z}), result=uid)
            for f, la, z, uid in PEOPLE]


@pytest.fixture(scope="module")
def retail():
    tools = _retail_tool()
    return tools, build_adaptation_tasks("retail", tools, _examples(), n=8, seed=0)


def test_builder_tasks_need_the_tool_no_duplicates_no_test_users(retail):
    tools, built = retail
    train, held = built["train"], built["held_out"]
    every = train + held
    assert len(every) == 8 and held and len(held) < len(train)
    for t in every:
        assert TOOL in {a.name for a in t.gold_actions}, t.id
        assert t.tools_added == [tools[0].spec] and t.id.startswith("retail/adapt-")
    assert len({t.id for t in every}) == len(every)
    keys = {(" ".join(t.first_user_message.lower().split()), json.dumps([a.model_dump() for a in t.gold_actions],
                                                                      sort_keys=True)) for t in every}
    assert len(keys) == len(every)
    db = domain_env("retail").tools.db
    test = load_tasks("retail", "test")
    test_users = synth_mod.test_users("retail", test, db)
    assert test_users and not synth_mod.test_users("retail", every, db) & test_users
    tau2_ids = {t.get("id") for t in (x.source for x in every)}
    assert not tau2_ids & {t.id.split("/", 1)[1] for t in test}


def test_builder_holds_out_real_tasks_only_and_examples_train(retail):
    _, built = retail
    made = [t for t in built["train"] if "envace_adapt" in t.source]
    assert len(made) == 3 and {t.gold_actions[0].arguments["last_name"] for t in made} == {"Lovelace", "Turing", "Hopper"}
    assert all(t.source["envace_adapt"]["origin"] == "example" and t.user_scenario == "" for t in made)
    assert "find user id by first name, last name, and zip code" in made[0].first_user_message.lower()
    assert "The zip is 10001." in made[0].first_user_message
    for t in built["held_out"]:  # replayable in the real environment: a tau2 record, scored by tau2
        assert t.split == "test" and t.source.get("evaluation_criteria") and "envace_adapt" not in t.source
        env = Tau2Environment("retail")
        env.reset(t)
        assert not env.step(t.gold_actions[0]).error


def test_a_task_about_an_example_user_is_never_held_out(retail):
    """An example naming a held-out task's user (same seed, same pool) moves that task to train."""
    tools, built = retail
    target = built["held_out"][0]
    call = next(a for a in target.gold_actions if a.name == TOOL)
    examples = _examples()[:2] + [ToolExample(call=call, result="whatever")]
    again = build_adaptation_tasks("retail", tools, examples, n=8, seed=0)
    assert target.id in {t.id for t in again["train"]} and target.id not in {t.id for t in again["held_out"]}
    assert {t.id for t in again["train"] + again["held_out"]} - {t.id for t in again["train"] if "envace_adapt" in t.source} \
        == {t.id for t in built["train"] + built["held_out"]} - {t.id for t in built["train"] if "envace_adapt" in t.source}


def test_gate_passes_and_can_fail(retail):
    _, built = retail
    assert adaptation_gate("retail", built["train"], built["held_out"]).success
    bad = built["train"][0].model_copy(deep=True)
    bad.gold_actions[0].arguments["zip"] = 12345  # not a string: violates the tool's schema
    bad.id = "retail/adapt-bad"
    res = adaptation_gate("retail", built["train"] + [bad], built["held_out"])
    assert not res.success and any("gold actions are valid calls" in f for f in res.failed)


def test_examples_only_tool_builds_example_tasks():
    tools = load_tools([{"type": "function", "function": {
        "name": "get_loyalty_points", "description": "Get the loyalty points balance of a customer. Read-only.",
        "parameters": {"type": "object", "properties": {"first_name": {"type": "string"},
                                                        "last_name": {"type": "string"},
                                                        "zip": {"type": "string"}},
                       "required": ["first_name", "last_name", "zip"]}}}])
    built = build_adaptation_tasks("retail", tools, _examples("get_loyalty_points")[:2], n=4, seed=0)
    assert built["held_out"] == [] and len(built["train"]) == 4
    assert all(t.gold_actions[0].name == "get_loyalty_points" and "envace_adapt" in t.source for t in built["train"])
    assert len({t.first_user_message for t in built["train"]}) == 4
    assert "get the loyalty points balance of a customer" in built["train"][0].first_user_message.lower()


def test_impossible_requests_raise_naming_why():
    made_up = load_tools([{"name": "teleport_parcel", "description": "Teleport a parcel.",
                                         "parameters": {"type": "object", "properties": {}}}])
    with pytest.raises(AdaptationError, match="teleport_parcel: it is neither a tool of the 'retail' domain "
                                              "nor has examples"):
        build_adaptation_tasks("retail", made_up, [], n=4)
    with pytest.raises(AdaptationError, match="at least 2 tasks"):
        build_adaptation_tasks("retail", made_up, [], n=1)
    with pytest.raises(AdaptationError, match="hidden tools .'no_such_tool'. are not tools of 'retail'"):
        build_adaptation_tasks("retail", _retail_tool(), _examples(), n=4, hidden=["no_such_tool"])


def test_guard_refuses_and_counts_real_calls_of_new_tools():
    env = Tau2Environment("retail")
    call = ToolCall(name=TOOL, arguments={"first_name": "Ada", "last_name": "Lovelace", "zip": "10001"})
    with RealCallGuard({TOOL}) as guard:
        obs = env.step(call)
        other = env.step(ToolCall(name="list_all_product_types", arguments={}))
    assert obs.error and "refused" in obs.content and not other.error
    assert guard.blocked_calls == 1 and guard.calls == {TOOL: 1, "list_all_product_types": 1}
    assert "refused" not in env.step(call).content  # the class is restored after the block


@pytest.fixture
def parent(tiny_model_dir, tmp_path):
    """A tiny LoRA adapter (r=2) on the tiny model, registered as tiny@v1; its config hid the tool."""
    from peft import LoraConfig, get_peft_model

    from envace_core.models import load_model, model_fingerprint
    from envace_core.store.registry import Registry

    art = tmp_path / "art"
    model = get_peft_model(load_model(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(art / "adapter")
    root = tmp_path / "registry"
    Registry(root).register("tiny", "v1", art, {
        "base_model": {"ref": str(tiny_model_dir), "sha256": model_fingerprint(tiny_model_dir)},
        "config": {"data": {"hidden_tools": [TOOL]}}})
    return root


def test_adapt_registers_a_child_naming_tools_and_parent_then_measure(parent, tmp_path, capsys):
    from envace_core.config import load_config
    from envace_core.models import resolve_model_ref
    from envace_core.store.registry import Registry

    cfg = load_config("test", {"model": {"compute_dtype": "float32"},
                               "store": {"root": str(tmp_path / "store"), "registry": str(parent)}})
    tools, examples = _retail_tool(), _examples()
    out = adapt(cfg, "registry:tiny@v1", tools, examples, domain="retail", n_tasks=4)
    assert out["name"] == "tiny" and out["version"] != "v1" and out["real_calls_to_new_tools"] == 0
    assert out["real_calls"] == {}  # no real environment call at all while training
    assert out["trained"]["iterations"] == 1 and out["tasks"]["held_out"] >= 1
    m = json.loads((parent / "tiny" / out["version"] / "manifest.json").read_text())
    raw = (parent / "tiny" / "v1" / "manifest.json").read_bytes()
    assert m["parent"] == {"ref": "registry:tiny@v1", "name": "tiny", "version": "v1",
                           "manifest_sha256": hashlib.sha256(raw).hexdigest(), "base_model": m["base_model"]["ref"]}
    assert m["tools"] == [{"name": TOOL, "schema_sha256": tool_schema_sha256(tools[0].spec)}]
    assert m["examples_sha256"] == examples_sha256(examples)
    assert m["dataset"]["version"] == out["dataset"]["version"]
    assert m["config"]["train"]["init_adapter"].endswith("tiny/v1/artifacts/adapter")
    assert m["config"]["train"]["lora_r"] == 2 and m["config"]["reward"]["name"] == "actions"
    if cfg.train.lora_r != 2:  # the config's r is replaced by the parent's, and the user is told
        assert f"train.lora_r={cfg.train.lora_r} from the config is replaced by the parent's 2" in capsys.readouterr().out
    assert m["adaptation"]["hidden_tools"] == [TOOL] and m["adaptation"]["real_calls_to_new_tools"] == 0
    assert "artifacts/tools.json" in m["artifacts"] and "artifacts/examples.jsonl" in m["artifacts"]
    assert Registry(parent).verify("tiny", out["version"]) == []
    child = resolve_model_ref(f"registry:tiny@{out['version']}", str(parent))
    assert child.base_ref == m["base_model"]["ref"]

    held = load_dataset(out["dataset"], "test")
    assert held and all(t.tools_added and t.tools_hidden == [TOOL] for t in held)
    res = measure(cfg, f"registry:tiny@{out['version']}", held, tools=[TOOL])
    for metric in ("success", "fidelity"):
        s = res[metric]
        assert s["n"] == len(held) and 0.0 <= s["ci95"][0] <= s["mean"] <= s["ci95"][1] <= 1.0
    assert res["fidelity"]["transitions"] >= len(held)
    assert [r["task_id"] for r in res["per_task"]] == [t.id for t in held]
    with pytest.raises(AdaptationError, match="no tau2 record"):
        measure(cfg, "registry:tiny@v1", load_dataset(out["dataset"], "train")[-1:], tools=[TOOL])


def test_a_tool_outside_the_domain_is_scored_by_its_implementation(monkeypatch):
    """Examples of a non-domain tool with an implementation: whole examples are held out (no phrasing
    of a held-out example is trained on) and `measure` scores them by running the implementation:
    a policy that makes the example's call and answers succeeds, and REHEARSE fidelity compares with
    the implementation's real result."""
    from envace_core.config import load_config
    from envace_core.models import load_tokenizer, resolve_model
    from envace_core.tool_learning.inputs import load_tools
    from envace_core.tool_learning.measure import measure
    from tests.scripted import ScriptedEngine

    (tool,) = load_tools([{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "implementation": "tests.tool_impls:get_weather"}])
    examples = [inputs.ToolExample(call=types_mod.ToolCall(name="get_weather", arguments={"city": c}),
                               result={"city": c, "temperature": 21, "unit": "celsius"})
                for c in ("Paris", "Rome", "Oslo", "Lima")]
    built = tasks.build_adaptation_tasks("retail", [tool], examples, n=12, seed=0, held_out=0.3)
    held, train = built["held_out"], built["train"]
    assert held and all(implementation_of(t) == {"get_weather": "tests.tool_impls:get_weather"} for t in held)
    held_cities = {t.gold_actions[0].arguments["city"] for t in held}
    assert held_cities.isdisjoint({t.gold_actions[0].arguments["city"] for t in train})

    tok = load_tokenizer(resolve_model("bundled:smollm2-135m-instruct"))
    city = held[0].gold_actions[0].arguments["city"]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>' % city
    engine = ScriptedEngine(tok, [call, "It is 21 degrees."],
                            rehearse_text='{"city": "%s", "temperature": 21, "unit": "celsius"}' % city)
    monkeypatch.setattr(models_mod, 'resolve_model_ref', lambda ref, reg: ref)
    monkeypatch.setattr(policy_mod, 'load_engine', lambda cfg, m: (engine, None))
    out = measure(load_config("test", "eval.max_turns=3"), "scripted", held[:1], tools=["get_weather"])
    assert out["success"]["mean"] == 1.0 and out["fidelity"]["mean"] == 1.0 and out["fidelity"]["transitions"] == 1
    wrong = ScriptedEngine(tok, ['<tool_call>{"name": "get_weather", "arguments": {"city": "Atlantis"}}</tool_call>',
                                 "Sorry."], rehearse_text='{"temperature": 5}')
    monkeypatch.setattr(policy_mod, 'load_engine', lambda cfg, m: (wrong, None))
    out = measure(load_config("test", "eval.max_turns=3"), "scripted", held[:1], tools=["get_weather"])
    assert out["success"]["mean"] == 0.0 and out["fidelity"]["mean"] < 1.0
