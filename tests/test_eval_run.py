"""`envace eval`: bench specs, model refs (registry included), a tiny-model end-to-end run, resume, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envace_core import EnvaceError
from envace_core.cli import main
from envace_core.evaluation.options import (
    BenchSpec,
    BenchSpecError,
    parse_benches,
    parse_rehearsal,
)
from envace_core.models import ModelRefError, resolve_model_ref
from envace_core.training.policy import load_engine

FINMCP = Path(__file__).parent / "fixtures" / "finmcp_sample.json"
VITA = Path(__file__).resolve().parents[2] / "shared" / "data" / "vitabench"
if not VITA.exists():
    VITA = Path("/work/shared/data/vitabench")


@pytest.fixture
def over(tmp_path):
    return json.dumps({"model": {"compute_dtype": "float32"},
                       "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})


# ------------------------------------------------------------------------------------------- specs
def test_specs_parse_and_normalise():
    got = parse_benches("tau2:airline, bfcl:simple,tau2:mock," f"finmcp:{FINMCP}")
    assert got == [BenchSpec("tau2", "airline"), BenchSpec("bfcl", "simple_python"), BenchSpec("tau2", "mock"),
                   BenchSpec("finmcp", str(FINMCP.resolve()))]
    assert parse_rehearsal("none") == ("none", 0)
    assert parse_rehearsal("parallel:4") == ("parallel", 4)
    assert parse_rehearsal("sequential:2") == ("sequential", 2)
    for bad in ("parallel:²", "parallel:٣", "sequential:"):  # str.isdigit() says yes to the first two
        with pytest.raises(EnvaceError, match="write none, parallel:N or sequential:N"):
            parse_rehearsal(bad)


@pytest.mark.parametrize("spec,needles", [
    ("tau3:airline", ["tau3", "tau2, bfcl, vita, finmcp"]),
    ("airline", ["BENCH:ARG"]),
    ("tau2:banking", ["banking", "airline, retail, telecom, mock"]),
    ("bfcl:java", ["java", "simple_python", "multi_turn_base", "live_simple"]),
    ("vita:/nonexistent/vita", ["/nonexistent/vita", "does not exist"]),
    ("finmcp:", ["finmcp needs the path"]),
    ("", ["empty"]),
    ("tau2:airline,", ["'tau2:airline,'", "empty item (a stray comma)"]),
    ("tau2:airline,,bfcl:simple", ["'tau2:airline,,bfcl:simple'", "empty item"]),
    (",", ["empty item"]),
    ("tau2", ["'tau2'", "tau2 needs a domain, e.g. tau2:airline"]),
    ("vita", ["vita needs the path of its data"]),
    ("tau2:airline,bfcl:simple,tau2:airline", ["lists 'tau2:airline' twice", "list each bench once"]),
    ("bfcl:simple,bfcl:simple_python", ["'bfcl:simple' and 'bfcl:simple_python', which name the same bench"]),
])
def test_bad_specs_name_the_item_and_the_choices(spec, needles):
    with pytest.raises(BenchSpecError) as e:
        parse_benches(spec)
    for n in needles:
        assert n in str(e.value)


@pytest.mark.parametrize("text", ["parallel", "parallel:0", "sideways:2", "parallel:x", "none:3"])
def test_bad_rehearsal_spec(text):
    with pytest.raises(EnvaceError, match="parallel:N"):
        parse_rehearsal(text)


def test_a_rehearsal_n_must_pass_the_bounds_of_the_setting_rehearsal_n():
    from envace_core.config_sections import RehearsalConfig
    from envace_core.evaluation.options import rehearsal_n_bounds

    lo, hi = rehearsal_n_bounds()
    meta = {type(m).__name__: m for m in RehearsalConfig.model_fields["n"].metadata}
    assert (lo, hi) == (meta["Ge"].ge, meta["Le"].le) == (1, 64)  # one bound, the config model's
    assert parse_rehearsal(f"parallel:{hi}") == ("parallel", hi)
    for text in (f"parallel:{hi + 1}", "sequential:1000", "parallel:0", "sequential:00"):
        with pytest.raises(EnvaceError, match=rf"--rehearsal '{text}': N = \d+ is outside 1\.\.64, the bounds of "
                                              r"the setting rehearsal\.n"):
            parse_rehearsal(text)
    with pytest.raises(EnvaceError, match="with 1 <= N <= 64"):
        parse_rehearsal("parallel:-2")


@pytest.mark.parametrize("rehearsal", ["parallel:1000", "sequential:65", "parallel:0"])
def test_eval_refuses_a_rehearsal_n_out_of_bounds_before_any_model_loads(rehearsal, eval_loads_no_model, over,
                                                                        tmp_path, capsys):
    argv = ["--profile", "test", "--overrides", over, "eval", "--model", "bundled:smollm2-135m-instruct",
            "--bench", "bfcl:multi_turn_base", "--rehearsal", rehearsal, "--limit", "1", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"envace: error: --rehearsal '{rehearsal}': N = "), err
    assert not (tmp_path / "o").exists()


def test_evaluate_workflow_refuses_a_rehearsal_n_out_of_bounds(eval_loads_no_model, over, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Flyte's local sandbox stays in tmp
    from workflows.evaluate import evaluate

    with pytest.raises(Exception, match=r"--rehearsal 'parallel:1000': N = 1000 is outside 1\.\.64"):
        evaluate(model="bundled:smollm2-135m-instruct", bench="tau2:mock", split="full", rehearsal="parallel:1000",
                 limit=1, out=str(tmp_path / "wf"), profile="test", overrides=over)
    assert not (tmp_path / "wf").exists()


def test_cli_reports_bad_spec_in_one_line_before_loading_a_model(capsys, tmp_path):
    assert main(["eval", "--model", "/nowhere/model", "--bench", "bfcl:cobol", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cobol" in err and "simple_python" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bench, needle", [
    ("vita", "no VitaBench task files named 'tasks_en.json' under"),
    ("finmcp", "no .json / .jsonl files under"),
])
def test_a_data_folder_without_the_benchs_files_is_refused_before_any_model_loads(bench, needle, eval_loads_no_model,
                                                                                over, tmp_path, capsys):
    data = tmp_path / "data"  # exists, but holds none of the bench's task files
    (data / "notes").mkdir(parents=True)
    argv = ["--profile", "test", "--overrides", over, "eval", "--model", "bundled:smollm2-135m-instruct",
            "--bench", f"{bench}:{data}", "--out", str(tmp_path / "out"), "--limit", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"envace: error: --bench item '{bench}:{data}': {needle}"), err
    assert not (tmp_path / "out").exists()  # a refused run leaves no --out folder behind


@pytest.mark.parametrize("model, needle", [
    ("bundled:nosuch", "--model 'bundled:nosuch': is an unknown bundled model: the only one is "
                       "'bundled:smollm2-135m-instruct'"),
    ("s3://", "--model 's3://': is not a valid S3 URI"),
])
def test_a_model_that_cannot_load_is_refused_before_out_is_made(model, needle, eval_loads_no_model, over, tmp_path,
                                                                capsys):
    argv = ["--profile", "test", "--overrides", over, "eval", "--model", model, "--bench", "bfcl:simple",
            "--out", str(tmp_path / "out"), "--limit", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"envace: error: {needle}"), err
    assert not (tmp_path / "out").exists()


def test_finmcp_data_that_is_not_utf8_is_one_line_error(eval_loads_no_model, over, tmp_path, capsys):
    data = tmp_path / "fin.json"
    data.write_bytes(b"\xff\xfe\x00")
    argv = ["--profile", "test", "--overrides", over, "eval", "--model", "bundled:smollm2-135m-instruct",
            "--bench", f"finmcp:{data}", "--out", str(tmp_path / "out"), "--limit", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not UTF-8 text" in err and str(data) in err, err


# ----------------------------------------------------------------------------------------- registry
@pytest.fixture
def registered(tiny_model_dir, tmp_path):
    """A tiny LoRA adapter on the tiny model, registered as tiny@v1 in a tmp registry."""
    from peft import LoraConfig, get_peft_model

    from envace_core.models import load_model, model_fingerprint
    from envace_core.store.registry import Registry

    art = tmp_path / "art"
    model = get_peft_model(load_model(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(art / "adapter")
    root = tmp_path / "registry"
    Registry(root).register("tiny", "v1", art, {"base_model": {"ref": str(tiny_model_dir),
                                                               "sha256": model_fingerprint(tiny_model_dir)}})
    return root


def test_registry_ref_verifies_then_loads_base_plus_adapter(registered, tiny_model_dir):
    from envace_core.config import load_config

    m = resolve_model_ref("registry:tiny@v1", str(registered))
    assert m.base_ref == str(tiny_model_dir) and m.manifest["version"] == "v1"
    assert Path(m.adapter_dir, "adapter_config.json").is_file()
    cfg = load_config("test", {"model": {"compute_dtype": "float32"}})
    engine, n = load_engine(cfg, m)
    _, n_base = load_engine(cfg, resolve_model_ref(str(tiny_model_dir), str(registered)))
    assert n > n_base  # the LoRA weights are loaded on top of the base
    assert type(engine.model).__name__.startswith("Peft")


def test_registry_ref_errors(registered):
    with pytest.raises(ModelRefError, match="NAME@VERSION"):
        resolve_model_ref("registry:tiny", str(registered))
    with pytest.raises(ModelRefError, match="not registered"):
        resolve_model_ref("registry:tiny@v9", str(registered))
    weights = next((registered / "tiny" / "v1" / "artifacts" / "adapter").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one flipped bit
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelRefError, match="fails verification.*adapter_model.safetensors"):
        resolve_model_ref("registry:tiny@v1", str(registered))


def test_registry_ref_refuses_another_base_model(registered, tmp_path):
    from envace_core.config import load_config

    mf = registered / "tiny" / "v1" / "manifest.json"
    m = resolve_model_ref("registry:tiny@v1", str(registered))
    m.manifest["base_model"]["sha256"] = "0" * 64  # as if the base folder had been swapped since training
    with pytest.raises(ModelRefError, match="base_model.sha256"):
        load_engine(load_config("test", {"model": {"compute_dtype": "float32"}}), m)
    assert mf.is_file()


# ------------------------------------------------------------------------------------ end to end
def _count_generate(monkeypatch) -> list[int]:
    from envace_core.engines.hf import HFEngine

    calls = [0]
    real = HFEngine.generate

    def counted(self, *a, **k):
        calls[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(HFEngine, "generate", counted)
    return calls


def test_tiny_model_end_to_end_then_resume(tiny_model_dir, over, tmp_path, capsys, monkeypatch):
    out = tmp_path / "evalrun"
    benches = f"tau2:airline,bfcl:simple,finmcp:{FINMCP}" + (f",vita:{VITA}" if VITA.exists() else "")
    argv = ["--profile", "test", "--overrides", over, "eval", "--model", str(tiny_model_dir), "--bench", benches,
            "--rehearsal", "parallel:2", "--limit", "1", "--max-steps", "4", "--out", str(out)]
    calls = _count_generate(monkeypatch)
    assert main(argv) == 0
    first = json.loads((out / "results.json").read_text())
    assert calls[0] > 0
    assert {b["bench"] for b in first["benches"]} >= {"tau2", "bfcl", "finmcp"}
    assert all(w["ran"] >= 1 and w["cached"] == 0 for w in first["work"].values())
    tau = next(b for b in first["benches"] if b["bench"] == "tau2")
    [rec] = tau["results"]
    assert rec["task_id"] == "airline/2" and rec["error"] is None and rec["reward"] in (0.0, 1.0)
    assert rec["protocol"] == first["settings"]["protocol"] == "tau2_orchestrator"  # envace eval's default
    assert tau["summary"]["pass_hat_k"]["1"] == rec["reward"]
    assert rec["agent_stats"]["rehearsal_rounds"] >= (1 if rec["agent_stats"]["act_calls"] else 0)
    bfcl = next(b for b in first["benches"] if b["bench"] == "bfcl")["report"]
    assert bfcl["categories"]["simple_python"]["n"] == 1 and not bfcl["complete"]
    for name in ("report.md", "report.html", "scores.png", "published_comparison.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from envace_core.evaluation.options import CACHE_DIR, REPORT_FILES

    assert {e.name for e in out.iterdir()} <= {*REPORT_FILES, CACHE_DIR}  # what check_out_folder knows as eval's
    printed = capsys.readouterr().out
    assert "report: " + str(out / "report.md") in printed and "simple_python" in printed

    assert first["code"]["cache_note"] is None and first["code"]["cache_history"][0]["episodes_ran"] > 0

    calls[0] = 0  # the same command again: everything comes from the cache, nothing is generated
    from envace_core.evaluation import code_ledger

    monkeypatch.setattr(code_ledger, "_process_code", lambda: ("f" * 40, False))  # as after an upgrade
    assert main(argv) == 0
    again = json.loads((out / "results.json").read_text())
    assert calls[0] == 0
    note = again["code"]["cache_note"]  # the reused episodes were played by the first run's code
    assert again["code"]["commit"] == "f" * 40 and note and "the code now: ffffffffffff" in note
    assert "**note**" in (out / "report.md").read_text() and "note: " in capsys.readouterr().out
    assert {k: w["cached"] for k, w in again["work"].items()} == {k: w["ran"] for k, w in first["work"].items()}
    assert all(w["ran"] == 0 for w in again["work"].values())
    assert [b.get("summary", b.get("report", b.get("micro"))) for b in again["benches"]] == \
        [b.get("summary", b.get("report", b.get("micro"))) for b in first["benches"]]


def test_report_states_model_user_and_labels_published_figures(tiny_model_dir, over, tmp_path):
    out = tmp_path / "r"
    assert main(["--profile", "test", "--overrides", over, "eval", "--model", str(tiny_model_dir), "--bench",
                 "bfcl:simple", "--limit", "1", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## Published figures beside ours" in md
    assert "| EnvACE-8B (published) | 46.04 | 36.7 | 16.0 | 32.91 |" in md
    assert "| Qwen3-8B (published) | 44.04 | 30.0 | 11.4 | 28.48 |" in md
    assert "| EnvACE-8B (published) | 46.78 | 54.04 |" in md
    assert "not measured here" in md and "arXiv:2608.06197" in md
    assert "M parameters" in md and "user simulator (tau2): the evaluated policy itself" in md
    res = json.loads((out / "results.json").read_text())
    assert res["model"]["n_params"] > 0 and res["headline"]["BFCL-v4"] == res["benches"][0]["report"]["overall"]
    html = (out / "report.html").read_text()
    assert "(published)" in html and "data:image/png;base64," in html


def test_evaluate_workflow_runs_locally_with_a_deck(tiny_model_dir, over, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Flyte's local sandbox stays in tmp
    from workflows.evaluate import evaluate

    out = json.loads(evaluate(model=str(tiny_model_dir), bench="bfcl:simple", limit=1, out=str(tmp_path / "wf"),
                              profile="test", overrides=over))
    assert out["benches"][0]["report"]["categories"]["simple_python"]["n"] == 1
    assert Path(out["report_paths"]["report"]).is_file() and len(out["report_paths"]["plots"]) == 2


# ------------------------------------------------------------------- one harness, two callers
@pytest.mark.parametrize("protocol", ["opening_request", "tau2_orchestrator"])
def test_evaluate_stage_and_envace_eval_give_the_same_records_and_the_manifest_names_the_protocol(
        tiny_model_dir, tmp_path, protocol):
    """The main job's evaluate stage and `envace eval` on the same model, task, protocol and seed give the
    same per-task records (with and without rehearsal); the registered manifest names the protocol."""
    from envace_core.config import load_config
    from envace_core.evaluation.protocols import PROTOCOLS
    from envace_core.stages.curate import curate
    from envace_core.stages.evaluate import evaluate
    from envace_core.stages.register import register

    over = {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
            "eval": {"protocol": protocol, "max_turns": 2}, "rollout": {"max_new_tokens_act": 6},
            "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}}
    cfg = load_config("test", over)
    ds = curate(cfg)
    stage = evaluate(cfg, ds, {"adapter_dir": None})
    assert stage["protocol"]["name"] == protocol and stage["protocol"]["skips"] == PROTOCOLS[protocol].skips
    by_cond = {c: [r for r in stage["results"] if r["condition"] == c] for c in ("no_rehearsal", "parallel:2")}
    assert all(len(rs) == 1 for rs in by_cond.values())  # the test profile's one test task, each condition
    for cond, rehearsal in (("no_rehearsal", "none"), ("parallel:2", "parallel:2")):
        out = tmp_path / f"eval-{rehearsal.replace(':', '')}"
        assert main(["--profile", "test", "--overrides", json.dumps(over), "eval", "--model", str(tiny_model_dir),
                     "--bench", "tau2:airline", "--protocol", protocol, "--rehearsal", rehearsal, "--limit", "1",
                     "--seed", str(cfg.train.seed), "--out", str(out)]) == 0
        res = json.loads((out / "results.json").read_text())
        assert res["protocol"]["tau2"]["name"] == protocol and res["settings"]["protocol"] == protocol
        [cli] = res["benches"][0]["results"]
        [job] = [{k: v for k, v in r.items() if k != "condition"} for r in by_cond[cond]]
        assert cli["protocol"] == protocol and cli["task_id"] == job["task_id"] == "airline/2"
        assert cli == json.loads(json.dumps(job, default=str))  # every field: reward, stats, terminations, ...
        if rehearsal != "none" and cli["agent_stats"]["act_calls"]:
            assert cli["agent_stats"]["rehearsals"] == 2  # the rehearsal condition did rehearse, in both
    summary = stage["summary"]["no_rehearsal|all"]
    assert summary["n"] == 1 and summary["pass^1"] == by_cond["no_rehearsal"][0]["success"]

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"lora")
    trained = {"adapter_dir": str(adapter), "base_model_dir": str(tiny_model_dir), "run_id": "r1", "history": []}
    reg = register(cfg, ds, trained, {"metrics": {}, "gate": {}}, stage)
    manifest = json.loads(Path(reg["manifest"]).read_text())
    assert set(manifest["metrics"]["evaluation"]) == {"no_rehearsal|airline", "no_rehearsal|all",
                                                      "parallel:2|airline", "parallel:2|all"}
    assert manifest["metrics"]["evaluation_protocol"]["name"] == protocol
    assert manifest["metrics"]["evaluation_protocol"]["turns"] == PROTOCOLS[protocol].turns


def test_an_out_path_that_is_a_file_is_refused_before_any_work(tmp_path):
    from envace_core.evaluation.options import EvalOptions

    f = tmp_path / "afile"
    f.write_text("x")
    for out in (f, f / "sub"):
        with pytest.raises(EnvaceError, match="exists and is not a folder"):
            EvalOptions(model="bundled:smollm2-135m-instruct", benches="bfcl:simple", out=str(out)).check()
    EvalOptions(model="bundled:smollm2-135m-instruct", benches="bfcl:simple", out=str(tmp_path / "new")).check()
    with pytest.raises(EnvaceError, match="--out: cannot use the path .File name too long"):
        EvalOptions(model="bundled:smollm2-135m-instruct", benches="bfcl:simple", out=str(tmp_path / ("a" * 300))).check()


# ------------------------------------------------------------------------------ --out of other files
def _earlier_out(d: Path, cache: bool = True, results: bool = True) -> Path:
    """A folder as an earlier `envace eval --out` leaves it (report files, a cache per fingerprint)."""
    d.mkdir(parents=True)
    for name in ("report.md", "report.html", "scores.png"):
        (d / name).write_text("eval's")
    if results:
        (d / "results.json").write_text(json.dumps({"fingerprint": "0123456789abcdef", "benches": []}))
    if cache:
        (d / "cache" / "0123456789abcdef").mkdir(parents=True)
        (d / "cache" / "0123456789abcdef" / "bfcl_simple_python_limit-1.json").write_text("{}")
    return d


def test_check_out_folder_accepts_new_empty_and_earlier_outs(tmp_path):
    from envace_core.evaluation.options import check_out_folder

    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    for d in (tmp_path / "new" / "sub", tmp_path / "empty", _earlier_out(tmp_path / "earlier"),
              _earlier_out(tmp_path / "no-cache", cache=False), _earlier_out(tmp_path / "interrupted", results=False),
              tmp_path / "afile"):  # a file in the way is EvalOptions.check's to name
        check_out_folder(str(d))
    (tmp_path / "interrupted" / "report.md").rename(tmp_path / "interrupted" / "report.md.tmp")  # a write cut short
    check_out_folder(str(tmp_path / "interrupted"))


@pytest.mark.parametrize("make, needle", [
    (lambda d: (d / "report.md").write_text("my notes"),
     "holds report.md but no eval resume cache (cache/<fingerprint>/) or eval results.json"),
    (lambda d: (d / "results.json").write_text('{"mine": 1}'), "holds results.json but no eval resume cache"),
    (lambda d: (_earlier_out(d / "x"), (d / "x" / "todo.txt").write_text("mine")), "did not write (todo.txt)"),
    (lambda d: [(d / f"f{i}.txt").write_text("") for i in range(7)],
     "did not write (f0.txt, f1.txt, f2.txt, f3.txt, f4.txt and 2 more)"),
    (lambda d: (d / "cache" / "not-a-fingerprint").mkdir(parents=True), "holds cache but no eval resume cache"),
])
def test_check_out_folder_refuses_a_folder_of_other_files(make, needle, tmp_path):
    from envace_core.evaluation.options import check_out_folder

    d = tmp_path / "o"
    d.mkdir()
    make(d)
    if (d / "x").exists():
        d = d / "x"
    with pytest.raises(EnvaceError) as e:
        check_out_folder(str(d))
    msg = str(e.value)
    assert needle in msg and "choose an empty or new folder" in msg and f"--out {str(d)!r}" in msg, msg


def test_check_out_folder_refuses_a_registry_version_and_a_folder_in_it(tmp_path):
    from envace_core.evaluation.options import check_out_folder

    version = tmp_path / "registry" / "envace-policy" / "20260101T000000Z-abcdef01"
    (version / "artifacts" / "adapter").mkdir(parents=True)
    (version / "manifest.json").write_text("{}")
    for d in (version, version / "eval", version / "artifacts" / "adapter"):
        with pytest.raises(EnvaceError, match=f"is inside the model registry version '{version}'"):
            check_out_folder(str(d))
    with pytest.raises(EnvaceError, match=r"did not write \(20260101T000000Z-abcdef01\)"):
        check_out_folder(str(version.parent))  # the model's folder of versions


def test_eval_refuses_an_out_of_the_users_files_before_any_model_loads(eval_loads_no_model, over, tmp_path, capsys):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "report.md").write_text("my report")
    (d / "results.json").write_text('{"my": "results"}')
    argv = ["--profile", "test", "--overrides", over, "eval", "--model", "bundled:smollm2-135m-instruct", "--bench",
            "bfcl:simple", "--limit", "1", "--out", str(d)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"envace: error: --out {str(d)!r} holds "), err
    assert "choose an empty or new folder" in err
    assert (d / "report.md").read_text() == "my report" and sorted(p.name for p in d.iterdir()) == ["report.md",
                                                                                                   "results.json"]


def test_evaluate_workflow_refuses_an_out_of_the_users_files(eval_loads_no_model, over, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Flyte's local sandbox stays in tmp
    from workflows.evaluate import evaluate

    d = tmp_path / "mine"
    d.mkdir()
    (d / "report.html").write_text("<p>mine</p>")
    with pytest.raises(Exception, match="holds report.html but no eval resume cache"):
        evaluate(model="bundled:smollm2-135m-instruct", bench="bfcl:simple", limit=1, out=str(d), profile="test",
                 overrides=over)
    assert (d / "report.html").read_text() == "<p>mine</p>"
