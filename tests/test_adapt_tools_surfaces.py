"""Where users meet tool learning: `envace adapt-tools`, the Flyte workflow
workflows/adapt_tools.py (run with `pyflyte run`), and the ready-to-run inputs in examples/tools/."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envace_core.cli import main

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "examples" / "tools" / "tools.json"
EXAMPLES = REPO / "examples" / "tools" / "examples.jsonl"
TOOL = "find_user_id_by_name_zip"


def _bad_tools(tmp_path: Path) -> Path:
    """A valid tool, then one whose `amount` parameter has the type 'money' (not a JSON Schema type)."""
    good = json.loads(TOOLS.read_text())[0]
    bad = {"type": "function", "function": {"name": "refund", "description": "Refund an order.", "parameters": {
        "type": "object", "properties": {"amount": {"type": "money"}}, "required": ["amount"]}}}
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"tools": [good, bad]}))
    return path


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load or adaptation fails the test: input errors must come first."""
    import envace_core.tool_learning.adapt as adapt_mod
    import envace_core.training.policy as policy_mod
    from envace_core import models

    def boom(*a, **k):
        raise AssertionError("a model was loaded / adaptation started before the inputs were checked")

    monkeypatch.setattr(policy_mod, 'load_policy', boom)
    monkeypatch.setattr(models, "resolve_model", boom)
    monkeypatch.setattr(adapt_mod, 'adapt', boom)


def test_cli_rejects_a_bad_schema_naming_the_field_without_loading_a_model(tmp_path, capsys, no_model_loads):
    rc = main(["adapt-tools", "--model", "bundled:smollm2-135m-instruct", "--tools", str(_bad_tools(tmp_path))])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and rc == 2
    assert err.startswith("envace: error:") and len(err.splitlines()) == 1, err
    assert "tools[1].function.parameters.properties.amount.type" in err and "'money'" in err


def test_cli_rejects_an_example_that_breaks_its_tool_schema(tmp_path, capsys, no_model_loads):
    ex = tmp_path / "ex.jsonl"
    ex.write_text(EXAMPLES.read_text().splitlines()[0] + "\n"
                  + json.dumps({"tool": TOOL, "arguments": {"first_name": "A", "zip": 12345}, "result": "x"}) + "\n")
    rc = main(["adapt-tools", "--model", "bundled:smollm2-135m-instruct", "--tools", str(TOOLS),
               "--examples", str(ex)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{ex}:2: arguments" in err
    assert "'last_name' is a required property" in err and "12345 is not of type 'string'" in err


def test_cli_rejects_a_set_without_a_value(capsys, no_model_loads):
    rc = main(["adapt-tools", "--model", "x", "--tools", str(TOOLS), "--set", "train.iterations"])
    assert rc == 2 and "--set 'train.iterations': write KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--trials", "3"], "--trials only shape --measure's held-out comparison: add --measure or drop it"),
    (["--seed", "5", "--trials", "1"], "--trials and --seed only shape --measure's held-out comparison: add --measure "
                                       "or drop them"),
])
def test_cli_refuses_measure_flags_without_measure(tmp_path, capsys, no_model_loads, flags, needle):
    store = ["--set", f"store.root={tmp_path / 'store'}", "--registry", str(tmp_path / "reg")]
    rc = main(["adapt-tools", "--model", "bundled:smollm2-135m-instruct", "--tools", str(TOOLS), *store, *flags])
    assert rc == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_cli_checks_task_count_model_and_name_before_building_tasks(tmp_path, capsys, monkeypatch):
    """Bad --tasks, --model or --name stop before any task is built or dataset written."""
    import envace_core.tool_learning.tasks as tasks_mod

    def boom(*a, **k):
        raise AssertionError("tasks were built before the model/name were checked")

    monkeypatch.setattr(tasks_mod, 'build_tasks', boom)
    store = ["--set", f"store.root={tmp_path / 'store'}", "--registry", str(tmp_path / "reg")]
    assert main(["adapt-tools", "--model", "bundled:smollm2-135m-instruct", "--tools", str(TOOLS),
                 "--tasks", "1"]) == 2
    assert "--tasks must be >= 2" in capsys.readouterr().err
    assert main(["adapt-tools", "--model", str(tmp_path / "nope"), "--tools", str(TOOLS), *store]) == 2
    err = capsys.readouterr().err
    assert f"--model '{tmp_path / 'nope'}'" in err and "no such file or folder" in err
    assert main(["adapt-tools", "--model", "envace-policy@20261129T000000Z-abc", "--tools", str(TOOLS), *store]) == 2
    assert "registry:envace-policy@20261129T000000Z-abc" in capsys.readouterr().err
    assert main(["adapt-tools", "--model", "bundled:smollm2-135m-instruct", "--tools", str(TOOLS),
                 "--name", "../evil", *store]) == 2
    assert "registry name '../evil'" in capsys.readouterr().err
    assert not (tmp_path / "store" / "datasets").exists()


def test_example_inputs_are_the_tau2_tool_and_real_calls_off_the_test_split():
    """examples/tools/ is what export.py makes from tau2 today, and no example user is a test user."""
    sys.path.insert(0, str(REPO / "examples" / "tools"))
    import export

    from envace_core.envs.tau2.synth import test_users
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.tool_learning.inputs import load_examples, load_tools

    assert export.render(3) == {"tools.json": TOOLS.read_text(), "examples.jsonl": EXAMPLES.read_text()}
    tools = load_tools(TOOLS)
    examples = load_examples(EXAMPLES, tools)
    assert [t.spec.name for t in tools] == [TOOL] and "Args:" in tools[0].doc and len(examples) == 3
    users = {e.result for e in examples}
    assert len(users) == 3 and not users & test_users("retail", load_tasks("retail", "test"))


# ------------------------------------------------------------------------------- end to end (tiny)
def _overrides(tiny_model_dir: Path, tmp_path: Path) -> str:
    return json.dumps({"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                       "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})


@pytest.fixture
def parent(tiny_model_dir, tmp_path):
    """A registered parent `registry:parent@v1`: the tiny model + a LoRA adapter laid out as
    `stages.register` writes it (adapter/, config.json; manifest with base_model ref and sha256)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from envace_core.config import load_config
    from envace_core.models import model_fingerprint
    from envace_core.store.registry import Registry

    cfg = load_config("test", _overrides(tiny_model_dir, tmp_path))
    art = tmp_path / "parent-artifacts"
    lora = LoraConfig(r=cfg.train.lora_r, lora_alpha=cfg.train.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=list(cfg.train.lora_target_modules), task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora).save_pretrained(art / "adapter")
    (art / "config.json").write_text(json.dumps(cfg.to_dict()))
    Registry(tmp_path / "registry").register("parent", "v1", art, {
        "base_model": {"ref": str(tiny_model_dir), "sha256": model_fingerprint(tiny_model_dir)},
        "config": cfg.to_dict()})
    return "registry:parent@v1"


def _adapted_versions(tmp_path: Path) -> list[tuple[str, str]]:
    from envace_core.store.registry import Registry

    return [v for v in Registry(tmp_path / "registry").list() if v != ("parent", "v1")]


def _check_lineage(tmp_path: Path, parent_ref: str) -> dict:
    from envace_core.store.registry import Registry

    (name, version), = _adapted_versions(tmp_path)
    reg = Registry(tmp_path / "registry")
    assert reg.verify(name, version) == []
    manifest = reg.show(name, version)
    assert manifest["parent"]["ref"] == parent_ref and manifest["parent"]["version"] == "v1"
    assert [t["name"] for t in manifest["tools"]] == [TOOL] and len(manifest["tools"][0]["schema_sha256"]) == 64
    return manifest


def test_cli_adapts_the_tiny_model_registers_a_version_and_measures(parent, tiny_model_dir, tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["--profile", "test", "--overrides", _overrides(tiny_model_dir, tmp_path), "adapt-tools",
               "--model", parent, "--tools", str(TOOLS), "--examples", str(EXAMPLES), "--tasks", "4",
               "--set", "train.iterations=1", "--name", "adapted", "--measure"])
    out = capsys.readouterr().out
    assert rc == 0, out
    manifest = _check_lineage(tmp_path, parent)
    assert f"adapted model: registry:adapted@{manifest['version']}" in out
    assert f"lineage manifest: {tmp_path / 'registry' / 'adapted' / manifest['version'] / 'manifest.json'}" in out
    assert f"tools: {TOOL} (3 examples)" in out and f"parent: {parent}" in out
    assert "real calls to the new tools during training: 0" in out
    table = out.split("held-out tasks that need the new tools:")[1]
    for label in ("real-environment success", "REHEARSE fidelity, new tools"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {label}"))
        assert row.count("|") == 6 and "[" in row  # parent and adapted cells carry a 95% CI


def test_pyflyte_run_adapt_tools_workflow_locally(parent, tiny_model_dir, tmp_path):
    """`pyflyte run workflows/adapt_tools.py adapt_tools ...`: check → config → adapt → measure."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/adapt_tools.py", "adapt_tools",
           "--model", parent, "--tools_file", str(TOOLS), "--examples_file", str(EXAMPLES), "--n_tasks", "4",
           "--config", "test", "--overrides", _overrides(tiny_model_dir, tmp_path), "--name", "adapted"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = _check_lineage(tmp_path, parent)
    assert f"registry:adapted@{manifest['version']}" in proc.stdout
    assert "real-environment success" in proc.stdout  # the measurement came back as an output


def test_workflow_stops_a_bad_schema_before_adapting(tmp_path, monkeypatch, no_model_loads):
    monkeypatch.chdir(tmp_path)
    from workflows.adapt_tools import adapt_tools

    with pytest.raises(Exception, match=r"tools\[1\]\.function\.parameters\.properties\.amount\.type"):
        adapt_tools(model="bundled:smollm2-135m-instruct", tools_file=str(_bad_tools(tmp_path)))


def test_tool_learning_tasks_are_uncached_and_the_gpu_launch_plan_fixes_the_profile():
    from tasks import images
    from workflows.adapt_tools import (
        adapt_tools,
        adapt_tools_gpu,
        adapt_tools_task,
        check_tool_inputs,
        measure_tools,
    )

    from tasks.resources import gpu_overrides

    # every task registers on the CPU tier; a GPU profile's branch puts the GPU stages on the GPU tier
    expect = {check_tool_inputs: images.CPU_IMAGE, adapt_tools_task: images.TRAIN_IMAGE,
              measure_tools: images.EVAL_IMAGE}
    for t, image in expect.items():
        assert t.container_image is image and t.resources.requests.gpu is None, t.name
        assert t.metadata.cache is False and t.metadata.timeout.total_seconds() > 0, t.name
    for stage in ("adapt_tools", "measure_tools"):
        over = gpu_overrides(stage)
        assert over["requests"].gpu == "1" and over["accelerator"] is not None, stage
    assert measure_tools.enable_deck
    assert adapt_tools_gpu.workflow is adapt_tools and set(adapt_tools_gpu.fixed_inputs.literals) == {"config"}
    assert adapt_tools_gpu.fixed_inputs.literals["config"].scalar.primitive.string_value == "gpu-8b"
