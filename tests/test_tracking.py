"""Training metrics as TensorBoard event files (envace_core.training.tracking), read back with TensorBoard's reader."""

from envace_core.training.tracking import read_scalars, scalars, write_history


def test_history_round_trips_through_tensorboard_event_files(tmp_path):
    history = [{"iteration": 1, "reward_mean/act": 0.25, "frac_zero_std": 1.0, "train/loss": float("nan"),
                "rows/masked": 2, "note": "x", "signal": True},
               {"iteration": 2, "reward_mean/act": 0.5, "frac_zero_std": 0.5, "train/loss": 0.125}]
    got = read_scalars(write_history(history, tmp_path / "tb"))
    assert got["reward_mean/act"] == [(1, 0.25), (2, 0.5)]
    assert got["frac_zero_std"] == [(1, 1.0), (2, 0.5)]
    assert got["train/loss"] == [(2, 0.125)]  # the NaN of iteration 1 is left out
    assert got["rows/masked"] == [(1, 2.0)]
    assert "note" not in got and "signal" not in got and "iteration" not in got


def test_rewriting_replaces_the_folder_so_a_resumed_run_has_no_duplicate_steps(tmp_path):
    logdir = tmp_path / "tb"
    write_history([{"iteration": 1, "x": 1.0}, {"iteration": 2, "x": 2.0}, {"iteration": 3, "x": 3.0}], logdir)
    # resumed from the iteration-2 checkpoint, iteration 3 ran again with another value
    write_history([{"iteration": 1, "x": 1.0}, {"iteration": 2, "x": 2.0}, {"iteration": 3, "x": 9.0}], logdir)
    assert read_scalars(logdir)["x"] == [(1, 1.0), (2, 2.0), (3, 9.0)]


def test_scalars_keeps_finite_numbers_only():
    assert scalars({"a": 1, "b": 2.5, "c": float("inf"), "d": None, "e": False, "f": "3"}) == {"a": 1.0, "b": 2.5}


def test_the_printed_tensorboard_command_names_the_environments_own_script(tmp_path, monkeypatch):
    import sys

    from envace_core.training.tracking import tensorboard_command

    exe = tmp_path / "venv" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(exe))
    assert tensorboard_command("/s/runs/r/tensorboard") == "tensorboard --logdir /s/runs/r/tensorboard"  # none there
    (exe.parent / "tensorboard").write_text("#!/bin/sh\n")
    assert tensorboard_command("/s/runs/r/tensorboard") == f"{exe.parent / 'tensorboard'} --logdir /s/runs/r/tensorboard"
