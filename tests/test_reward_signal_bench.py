"""benchmarks/reward_signal.py on a hand-made run folder: the buckets and frac_zero_std the training loop would
compute for each λ, groups told apart by task and group_index, bad arguments refused before anything is read."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from envace_core.types import Generation, Observation, Role, Step, ToolCall, Trajectory

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("reward_signal", ROOT / "benchmarks" / "reward_signal.py")


def _bench():
    bench = importlib.util.module_from_spec(_SPEC)
    _SPEC.loader.exec_module(bench)
    return bench


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
    (["--estimator", "nope"], "registered"),
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
