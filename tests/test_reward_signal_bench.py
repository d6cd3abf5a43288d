"""benchmarks/reward_signal.py on a hand-made run folder: the buckets and frac_zero_std the training loop would
compute for each λ, groups told apart by task and group_index, bad arguments refused before anything is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envace_core.types import Generation, Observation, Role, Step, ToolCall, Trajectory
from tests.benchmark_loader import load_benchmark


def _bench():
    return load_benchmark("reward_signal")


def _gen(role: Role) -> Generation:
    return Generation(role=role, prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1])


def _traj(task: str, k: int, reward: float, fidelities: list[float]) -> Trajectory:
    """ACT called one tool per fidelity value; REHEARSE imagined each answer (fidelity F against the real one)."""
    steps, gens = [], []
    for f in fidelities:
        steps.append(Step(action=ToolCall(name="get_user_details", arguments={"user_id": "u"}),
                          observation=Observation(content="{}"), real_observation=Observation(content="{}"),
                          fidelity=f))
        gens += [_gen(Role.ACT), _gen(Role.REHEARSE)]
    gens.append(_gen(Role.ACT))
    return Trajectory(task_id=task, group_index=k, steps=steps, generations=gens, termination="agent_message",
                      reward=reward)


def _write_run(tmp_path: Path, iterations: list[list[Trajectory]]) -> Path:
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    for i, trajs in enumerate(iterations, 1):
        (run / "rollouts" / f"iteration-{i:04d}.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in trajs))
    return run


def test_fidelity_weight_gives_rehearse_buckets_a_signal_only_where_fidelities_differ(tmp_path, capsys):
    # task a: every trajectory fails alike, fidelities differ -> ACT zero std; REHEARSE zero std only at λ = 0
    # task b: one success -> ACT and REHEARSE carry signal at every λ
    # task c: rewards equal and fidelities equal -> zero std in both roles at every λ
    it1 = ([_traj("a", 0, 0.0, [1.0]), _traj("a", 1, 0.0, [0.2])]
           + [_traj("b", 0, 1.0, [0.5]), _traj("b", 1, 0.0, [0.5])]
           + [_traj("c", 0, 0.0, [1.0, 1.0]), _traj("c", 1, 0.0, [1.0])])
    it2 = [_traj("a", 0, 0.0, [0.3]), _traj("a", 1, 0.0, [0.3]), _traj("a", 0, 0.0, [0.9]), _traj("a", 1, 0.0, [0.1])]
    out = tmp_path / "rs.json"
    assert _bench().main(["--run", str(_write_run(tmp_path, [it1, it2])), "--lambdas", "0,0.5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    it1r, it2r = report["runs"]["iteration-0001.jsonl"], report["runs"]["iteration-0002.jsonl"]
    assert it1r["0.0"]["buckets"] == it1r["0.5"]["buckets"] == 6
    assert it1r["0.0"]["frac_zero_std"] == pytest.approx(4 / 6)  # a: both roles, c: both roles
    assert it1r["0.5"]["frac_zero_std"] == pytest.approx(3 / 6)  # a's REHEARSE now differs
    # the same task drawn twice in a row is two groups (group_index restarts at 0), each with its own baselines
    assert it2r["0.0"]["groups"] == 2 and it2r["0.0"]["buckets"] == 4
    assert it2r["0.0"]["frac_zero_std"] == 1.0 and it2r["0.5"]["frac_zero_std"] == pytest.approx(3 / 4)
    assert it2r["0.5"]["rehearse_reward_range"] == [pytest.approx(0.05), pytest.approx(0.45)]
    assert report["summary"]["0.5"]["max_frac_zero_std"] == pytest.approx(3 / 4)
    assert "iteration-0002.jsonl" in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["--lambdas", ""], "--lambdas is empty"),
    (["--lambdas", "0,-1"], "λ must be a finite number"),
    (["--lambdas", "0,nan"], "λ must be a finite number"),
    (["--lambdas", "0,x"], "'x' is not a number"),
    (["--lambdas", "0.5,0.5"], "more than once"),
    (["--estimator", "nope"], "registered: role_wise"),
    (["--json", ""], "--json: is empty"),
])
def test_bad_arguments_are_refused(tmp_path, capsys, args, fragment):
    run = _write_run(tmp_path, [[_traj("a", 0, 0.0, [1.0]), _traj("a", 1, 1.0, [1.0])]])
    with pytest.raises(SystemExit):
        _bench().main(["--run", str(run), *args])
    assert fragment in capsys.readouterr().err


def test_a_folder_without_rollouts_or_with_a_broken_line_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _bench().main(["--run", str(tmp_path)])
    assert "no rollouts/iteration-*.jsonl" in capsys.readouterr().err
    run = _write_run(tmp_path, [[_traj("a", 0, 0.0, [1.0])]])
    with open(run / "rollouts" / "iteration-0001.jsonl", "a") as f:
        f.write('{"task_id": 3\n')
    with pytest.raises(SystemExit):
        _bench().main(["--run", str(run), "--json", str(tmp_path / "x.json")])
    assert "line 2: not a stored trajectory" in capsys.readouterr().err


def _one_iteration(tmp_path: Path, trajs: list[Trajectory]) -> Path:
    return _write_run(tmp_path, [trajs])


@pytest.mark.parametrize("make, fragment", [
    (lambda d: [], "holds no trajectory"),
    (lambda d: [_traj("a", 0, 0.0, [1.0]), _traj("a", 1, 1.0, [1.0]), _traj("b", 0, 0.0, [1.0])],
     "groups of [1, 2] trajectories"),                      # a file cut inside its last group
    (lambda d: [_traj("a", 0, 0.0, [1.0]), _traj("a", 0, 1.0, [1.0])], "groups of [1] trajectories"),
    (lambda d: [_traj("a", 1, 0.0, [1.0]), _traj("a", 2, 1.0, [1.0])], "group_index 1 of task a does not follow"),
])
def test_a_rollouts_file_that_is_not_whole_groups_is_refused(tmp_path, capsys, make, fragment):
    run = _one_iteration(tmp_path, make(tmp_path))
    with pytest.raises(SystemExit):
        _bench().main(["--run", str(run), "--json", str(tmp_path / "x.json")])
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_report_may_not_go_into_the_run_and_odd_files_are_named(tmp_path, capsys):
    run = _one_iteration(tmp_path, [_traj("a", 0, 0.0, [1.0]), _traj("a", 1, 1.0, [0.5])])
    stored = (run / "rollouts" / "iteration-0001.jsonl").read_text()
    for inside in (run / "rollouts" / "iteration-0001.jsonl", run / "report.json"):
        with pytest.raises(SystemExit):
            _bench().main(["--run", str(run), "--json", str(inside)])
        assert "is inside --run" in capsys.readouterr().err
    assert (run / "rollouts" / "iteration-0001.jsonl").read_text() == stored and not (run / "report.json").exists()
    (run / "rollouts" / "iteration-0002.jsonl").write_bytes(b"{\"task_id\": \"\xff\"}\n")
    with pytest.raises(SystemExit):
        _bench().main(["--run", str(run), "--json", str(tmp_path / "x.json")])
    assert "iteration-0002.jsonl: cannot be read as text" in capsys.readouterr().err


def test_glob_characters_in_the_run_path_and_minus_zero(tmp_path):
    run = _write_run(tmp_path / "br[1]", [[_traj("a", 0, 0.0, [1.0]), _traj("a", 1, 1.0, [0.5])]])
    out = tmp_path / "rs.json"
    assert _bench().main(["--run", str(run), "--lambdas=-0,0.5", "--json", str(out)]) == 0
    assert sorted(json.loads(out.read_text())["summary"]) == ["0.0", "0.5"]


def test_shared_baseline_counts_one_bucket_per_group(tmp_path):
    run = _one_iteration(tmp_path, [_traj("a", 0, 0.0, [1.0]), _traj("a", 1, 1.0, [0.5]),
                                    _traj("b", 0, 0.0, [1.0]), _traj("b", 1, 0.0, [1.0])])
    out = tmp_path / "rs.json"
    assert _bench().main(["--run", str(run), "--lambdas", "0", "--estimator", "shared_baseline",
                          "--json", str(out)]) == 0
    it = json.loads(out.read_text())["runs"]["iteration-0001.jsonl"]["0.0"]
    assert it["buckets"] == 2 and it["frac_zero_std"] == 0.5
