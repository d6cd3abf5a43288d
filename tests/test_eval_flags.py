"""`envace eval` flags: an empty or blank value is an error naming the flag (never "not given"), a user or judge
flag that no selected bench or protocol uses is an error naming it and why, both before any model loads or
any file is written; and the resume cache's fingerprint depends only on what changes the episodes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import pytest

from envace_core.cli import main
from envace_core.config import load_config
from envace_core.evaluation.options import EvalOptions, fingerprint, parse_benches
from envace_core.models import resolve_model_ref

MODEL = "bundled:smollm2-135m-instruct"
DEAD = "http://127.0.0.1:9/v1"


@pytest.fixture
def over(tmp_path):
    return f"store.root={tmp_path / 'store'},store.registry={tmp_path / 'reg'}"


def _eval(over: str, *args: str) -> int:
    return main(["--profile", "test", "--overrides", over, "eval", *args])


# ------------------------------------------------------------------------------------ empty values
@pytest.mark.parametrize("flag, value", [
    ("--out", ""), ("--out", "  "), ("--user-url", ""), ("--user-model", ""), ("--judge-url", " "),
    ("--judge-model", ""), ("--user-url-model", ""), ("--model", ""), ("--model", " "), ("--bench", ""),
    ("--rehearsal", ""),
])
def test_an_empty_flag_is_an_error_naming_it_before_any_work(flag, value, eval_loads_no_model, over, tmp_path, monkeypatch,
                                                             capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    argv = {"--model": MODEL, "--bench": "tau2:airline", "--out": str(tmp_path / "out"), flag: value}
    rc = _eval(over, *[x for k, v in argv.items() for x in (k, v)], "--limit", "1", "--max-steps", "2")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"envace: error: {flag} is empty"), err
    assert list(cwd.iterdir()) == []  # nothing written where the command ran (an empty --out is not ".")
    assert flag == "--out" or not (tmp_path / "out" / "cache").exists()


# ----------------------------------------------------------------------------------- unused flags
@pytest.mark.parametrize("bench, extra, needle", [
    ("tau2:airline", ["--judge-url", DEAD], "--judge-url: no selected bench uses a judge (VitaBench does)"),
    ("tau2:airline", ["--judge-model", "/nonexist"], "--judge-model: no selected bench uses a judge (VitaBench does)"),
    ("tau2:airline", ["--protocol", "opening_request", "--user-url", DEAD],
     "--user-url: --protocol opening_request runs no user simulator (tau2_orchestrator does)"),
    ("tau2:airline", ["--protocol", "opening_request", "--user-model", MODEL],
     "--user-model: --protocol opening_request runs no user simulator"),
    ("bfcl:simple", ["--user-url", DEAD], "--user-url: no selected bench uses a user simulator"),
    ("vita:{tmp}", ["--judge-url", DEAD, "--user-url", DEAD],
     "--user-url: no selected bench uses a user simulator (tau2 does); VitaBench is judged by --judge-url"),
    ("tau2:airline", ["--user-url-model", "qwen"], "--user-url-model: it names the model sent to --user-url"),
    # tau2's own flags on a run without tau2 (or without its orchestrator)
    ("bfcl:simple", ["--split", "full"], "--split: no selected bench uses it (it picks tau2's task split)"),
    ("bfcl:simple", ["--protocol", "opening_request"], "--protocol: no selected bench uses it"),
    ("bfcl:simple", ["--max-steps", "7"], "--max-steps: no selected bench uses it"),
    ("tau2:airline", ["--protocol", "opening_request", "--max-steps", "7"],
     "--max-steps: --protocol opening_request runs no orchestrator (it counts tau2 steps under --protocol "
     "tau2_orchestrator)"),
    ("bfcl:simple", ["--trials", "3"], "--trials: no selected bench uses it (pass^k trials run for tau2 and VitaBench"),
    ("bfcl:simple", ["--rehearsal", "parallel:4"], "--rehearsal: no selected bench uses it (Private Rehearsal runs on "
                                                    "tau2, VitaBench and BFCL multi-turn"),
])
def test_a_flag_no_selected_bench_uses_is_an_error_naming_it_and_why(bench, extra, needle, eval_loads_no_model, over,
                                                                     tmp_path, capsys):
    out = tmp_path / "out"
    rc = _eval(over, "--model", MODEL, "--bench", bench.format(tmp=tmp_path), "--limit", "1", "--out", str(out),
               *extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith(f"envace: error: {needle}"), err
    assert not out.exists()  # refused before --out is made, and no endpoint was probed (port 9 would refuse)


def test_mock_with_split_test_is_refused_naming_its_only_split_before_any_work(eval_loads_no_model, over, tmp_path,
                                                                              capsys):
    out = tmp_path / "out"
    for split in (["--split", "test"], []):  # test is the default
        rc = _eval(over, "--model", MODEL, "--bench", "tau2:airline,tau2:mock", "--limit", "1", "--out", str(out), *split)
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert err == ("envace: error: --split test: tau2 domain 'mock' has no test split (its only split is base, "
                       "all its tasks): give --split full to run them"), err
        assert not out.exists()
    EvalOptions(model=MODEL, benches="tau2:mock", out=str(out), split="full").check(parse_benches("tau2:mock"))


def test_used_flags_still_pass_the_check(tmp_path):
    vita = str(tmp_path)
    for kw, benches in [({"user_url": DEAD}, "tau2:airline"), ({"judge_url": DEAD}, f"vita:{vita}"),
                        ({"user_url": DEAD}, f"vita:{vita}"),  # the user simulator judges VitaBench by default
                        ({"user_url": DEAD, "judge_model": "/x"}, f"tau2:airline,vita:{vita}"),
                        ({"judge_url": DEAD, "user_url_model": "qwen"}, f"vita:{vita}")]:
        opts = EvalOptions(model=MODEL, benches=benches, out=str(tmp_path / "o"), **kw)
        opts.check(parse_benches(benches))


# ------------------------------------------------------------------------------------ fingerprint
def _old_fingerprint(opts: EvalOptions, cfg, model) -> str:
    """The formula caches were written under before: a run whose flags are all used keeps its cache (the
    config of then had no eval.concurrency)."""
    keep = {k: v for k, v in asdict(opts).items() if k not in ("benches", "out", "limit", "trials", "split")}
    keep["model_version"] = (model.manifest or {}).get("version")
    keep["config"] = {k: cfg.to_dict()[k] for k in ("model", "data", "rollout", "rehearsal", "eval")}
    keep["config"]["eval"].pop("concurrency")
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_fingerprint_depends_only_on_what_changes_the_episodes(tmp_path):
    cfg = load_config("test", "")
    model = resolve_model_ref(MODEL, str(tmp_path / "reg"), base_ref=cfg.model.ref)

    def fp(benches="tau2:airline", **kw):
        return fingerprint(EvalOptions(model=MODEL, benches=benches, out=str(tmp_path), **kw), cfg, model)

    base = fp()
    assert base == _old_fingerprint(EvalOptions(model=MODEL, benches="tau2:airline", out="x"), cfg, model)
    assert fp(user_url=DEAD, user_url_model="qwen") == _old_fingerprint(
        EvalOptions(model=MODEL, benches="", out="", user_url=DEAD, user_url_model="qwen"), cfg, model)
    # unused by the selected benches: the same cache (the CLI refuses these flags; callers of fingerprint may not)
    opening = fp(protocol="opening_request")
    assert fp(protocol="opening_request", user_url=DEAD) == opening
    assert fp(protocol="opening_request", user_model="/x", max_steps=7, user_url_model="qwen") == opening
    assert fp(judge_url=DEAD) == fp(judge_model="/nonexist") == base
    assert fp("bfcl:simple", protocol="opening_request", max_steps=9) == fp("bfcl:simple")
    # where files go is not an episode setting, nor how many episodes share a batch
    assert fp(overrides=f"store.root={tmp_path}/a,store.registry={tmp_path}/r") == base
    assert fingerprint(EvalOptions(model=MODEL, benches="tau2:airline", out=str(tmp_path)),
                       load_config("test", "eval.concurrency=1"), model) == base
    assert fp(overrides=f"store.root={tmp_path}/a,rollout.temperature=0.5") == \
        fp(overrides=f"rollout.temperature=0.5,store.root={tmp_path}/b") != base
    # what the run uses still splits the cache
    assert len({base, opening, fp(user_url=DEAD), fp(user_model="/x"), fp(max_steps=7), fp(seed=1),
                fp(user_url=DEAD, user_url_model="qwen")}) == 7
    vita = f"vita:{tmp_path}"
    assert len({fp(vita), fp(vita, judge_url=DEAD), fp(vita, judge_model="/x"), fp(vita, user_url=DEAD)}) == 4
    # one rehearsal setting, one cache, however it is spelt; another N or mode is another cache
    p2 = fp(rehearsal="parallel:2")
    assert fp(rehearsal=" parallel:2") == fp(rehearsal="parallel:02") == fp(rehearsal="parallel:2 ") == p2
    assert fp(rehearsal="") == fp(rehearsal=" none") == base
    assert len({base, p2, fp(rehearsal="parallel:4"), fp(rehearsal="sequential:2")}) == 4
    assert p2 == _old_fingerprint(EvalOptions(model=MODEL, benches="", out="", rehearsal="parallel:2"), cfg, model)
