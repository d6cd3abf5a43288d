"""One training iteration (`training.loop.train_iteration`) on stubs: the row contract end to end,
and separate baselines for two groups of one task drawn in the same iteration."""

from __future__ import annotations

import pytest

import envace_core.training.loop as loop
from envace_core.config import load_config
from envace_core.envs.tau2.tasks import load_tasks
from envace_core.training.checkpoint import RunState
from envace_core.training.distributed import World
from envace_core.types import Generation, Role, Trajectory


class _Trainer:
    model = None
    optimizer_steps = 0

    def __init__(self):
        self.updates = []

    def update(self, rows):
        self.updates.append(rows)
        return {"loss": 0.5}


class _Store:
    def __init__(self):
        self.written = {}

    def write_bytes(self, key, data):
        self.written[key] = data


class _Engine:
    stats = {"generated_tokens": 0}


def _traj(task_id, g, reward, roles=(Role.ACT, Role.REHEARSE, Role.ACT)):
    return Trajectory(task_id=task_id, group_index=g, reward=reward, termination="agent_message",
                      generations=[Generation(role=r, prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1])
                                   for r in roles])


@pytest.fixture
def one_task_run(monkeypatch):
    """A run over a train split of one task with tasks_per_iteration=2: the task is drawn twice."""
    task = load_tasks("airline", "train", limit=1)[0]
    cfg = load_config("test", {"rollout": {"tasks_per_iteration": 2, "group_size": 2},
                               "train": {"iterations": 4, "checkpoint_every": 4, "trained_roles": ["act"]}})
    rewards = iter([[1.0, 0.0], [1.0, 1.0]])  # group 0 has signal, group 1 has none

    def roll_out(run, batch, iteration):
        return [[_traj(t.id, g, r) for g, r in enumerate(next(rewards))] for t in batch]

    monkeypatch.setattr(loop, "roll_out", roll_out)
    run = loop.TrainingRun(cfg, [task], _Trainer(), _Engine(), None, World(), _Store(), "run0")
    return run, task


def test_a_task_drawn_twice_gets_two_groups_with_their_own_baselines(one_task_run):
    run, task = one_task_run
    state = RunState()
    rec = loop.train_iteration(run, state)
    (rows,) = run.trainer.updates
    assert {r.role for r in rows} == {"act"}  # REHEARSE is frozen here: its rows are not trained
    assert [(r.group_id, r.trajectory_index) for r in rows] == [
        (f"1/0/{task.id}", 0), (f"1/0/{task.id}", 0), (f"1/0/{task.id}", 1), (f"1/0/{task.id}", 1),
        (f"1/1/{task.id}", 0), (f"1/1/{task.id}", 0), (f"1/1/{task.id}", 1), (f"1/1/{task.id}", 1)]
    # group 0: b = 0.5 -> +-0.5; group 1: b = 1 -> 0 (one baseline over both would give 0.25 / -0.75)
    assert [r.advantage for r in rows] == [0.5, 0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    assert rec["frac_zero_std"] == 0.5  # act and rehearse buckets: group 1's two are all-equal
    assert rec["train/loss"] == 0.5 and rec["trajectories"] == 4 and rec["iteration"] == 1
    assert (rec["data/epoch"], rec["data/position"]) == (0, 0)
    assert state.iteration == 1 and state.history == [rec] and state.cursor == {"epoch": 2, "position": 0}
    assert list(run.store.written) == ["runs/run0/rollouts/iteration-0001.jsonl"]
    assert run.store.written["runs/run0/rollouts/iteration-0001.jsonl"].count(b"\n") == 4


def test_failed_reward_rows_are_masked_not_trained_as_zero(monkeypatch, one_task_run):
    run, task = one_task_run
    monkeypatch.setattr(loop, "roll_out", lambda run, batch, it: [
        [_traj(t.id, 0, 1.0), _traj(t.id, 1, 0.0), _traj(t.id, 2, None)] for t in batch])
    rec = loop.train_iteration(run, RunState())
    (rows,) = run.trainer.updates
    assert len(rows) == 8 and all(r.valid and r.reward is not None for r in rows)  # the None trajectory is out
    assert rec["reward_mean/act"] == 0.5  # its rows are not counted as 0


def test_each_groups_freed_heap_goes_back_before_the_next_group_rolls_out(monkeypatch):
    import envace_core.training.rollout as rollout

    tasks = load_tasks("airline", "train", limit=3)
    cfg = load_config("test", {"rollout": {"tasks_per_iteration": 3, "group_size": 2}})
    events = []
    monkeypatch.setattr(rollout, "training_group",
                        lambda engine, task, cfg, params, seed: events.append(task.id) or [_traj(task.id, 0, 1.0)])
    monkeypatch.setattr(loop, "release_free_heap", lambda: events.append("trim") or True)
    run = loop.TrainingRun(cfg, tasks, _Trainer(), _Engine(), None, World(), _Store(), "run0")
    groups = loop.roll_out(run, tasks, 0)
    assert [g[0].task_id for g in groups] == [t.id for t in tasks]
    assert events == [tasks[0].id, "trim", tasks[1].id, "trim", tasks[2].id, "trim"]


def test_training_table_names_the_rollout_source(capsys):
    """The per-iteration table says which method produced it: imagined rollouts are World Rehearsal, real
    rollouts standard GRPO (the learning benchmark prints both in one log)."""
    from envace_core.stages.console import print_training_table

    rec = {"iteration": 1, "reward_mean/act": 0.5, "frac_zero_std": 0.0, "seconds": 1.0}
    print_training_table([rec], "real")
    out = capsys.readouterr().out
    assert "standard GRPO (real rollouts) training" in out and "World Rehearsal" not in out
    print_training_table([rec], "imagined")
    assert "World Rehearsal training" in capsys.readouterr().out
