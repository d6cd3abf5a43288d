"""The evaluation cache's code ledger: which code played the episodes a run reuses."""

import json

from envace_core.evaluation import code_ledger as L

A = {"commit": "a" * 40, "dirty": False}
B = {"commit": "b" * 40, "dirty": False}


def test_record_appends_one_line_per_run_and_history_merges_per_code_version(tmp_path):
    L.record(tmp_path, 3, A)
    L.record(tmp_path, 0, B)  # a run that played nothing leaves no line
    L.record(tmp_path, 2, A)
    L.record(tmp_path, 1, B)
    lines = (tmp_path / L.LEDGER_NAME).read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["episodes_ran"] == 3
    hist = L.history(tmp_path)
    assert [(h["commit"][0], h["episodes_ran"]) for h in hist] == [("a", 5), ("b", 1)]
    assert hist[0]["first"] <= hist[0]["last"]


def test_a_damaged_ledger_line_is_skipped_not_fatal(tmp_path):
    L.record(tmp_path, 2, A)
    with (tmp_path / L.LEDGER_NAME).open("a") as f:
        f.write("{not json\n" + json.dumps({"commit": "c" * 40}) + "\n")
    assert [h["episodes_ran"] for h in L.history(tmp_path)] == [2]
    assert L.history(tmp_path / "absent") == []


def test_no_note_when_nothing_is_reused_or_all_came_from_the_running_clean_commit(tmp_path):
    assert L.reuse_note(tmp_path, 0, A) is None
    L.record(tmp_path, 4, A)
    assert L.reuse_note(tmp_path, 4, A) is None
    assert L.reuse_note(tmp_path, 3, A) is None  # fewer reused than recorded (errors are replayed, never cached)


def test_the_note_names_other_code_and_unaccounted_episodes(tmp_path):
    L.record(tmp_path, 4, A)
    note = L.reuse_note(tmp_path, 4, B)
    assert note and "4 at aaaaaaaaaaaa" in note and "the code now: bbbbbbbbbbbb" in note and "--out" in note
    note = L.reuse_note(tmp_path, 6, A)  # 2 more reused than any run recorded
    assert note and "2 the ledger does not account for" in note and "aaaaaaaaaaaa" not in note.split("(")[1]
    fresh = tmp_path / "before-ledger"
    fresh.mkdir()
    assert "5 the ledger does not account for" in L.reuse_note(fresh, 5, A)


def test_uncommitted_or_unknown_code_is_never_taken_for_the_same_code(tmp_path):
    dirty = {"commit": "a" * 40, "dirty": True}
    L.record(tmp_path, 2, dirty)
    assert "aaaaaaaaaaaa with uncommitted changes" in L.reuse_note(tmp_path, 2, dirty)
    assert "with uncommitted changes" in L.reuse_note(tmp_path, 2, A)
    unknown = tmp_path / "u"
    L.record(unknown, 1, {"commit": None, "dirty": None})
    assert "an unknown commit" in L.reuse_note(unknown, 1, {"commit": None, "dirty": None})


def test_code_version_is_this_checkout_or_the_image_build_file():
    code = L.code_version()
    assert set(code) == {"commit", "dirty"}
    assert code["commit"] is None or len(code["commit"]) == 40


def test_episodes_cached_before_the_ledger_began_are_always_noted(tmp_path):
    (tmp_path / "tau2_airline.jsonl").write_text('{"task_id": "old"}\n')
    L.begin(tmp_path)  # the folder held episodes: the ledger's first line marks them
    L.begin(tmp_path)  # once
    L.record(tmp_path, 5, A)
    assert [h.get("before_ledger", False) for h in L.history(tmp_path)] == [True, False]
    note = L.reuse_note(tmp_path, 5, A)  # as many as the running commit played, yet some may be the old ones
    assert note and "before this ledger began" in note
    empty = tmp_path / "empty"
    empty.mkdir()
    L.begin(empty)
    assert not (empty / L.LEDGER_NAME).exists()


def test_lines_with_wrong_types_are_skipped_and_a_cut_line_does_not_swallow_the_next(tmp_path):
    bad = [{"date": "d", "commit": 12345, "dirty": False, "episodes_ran": 1},
           {"date": "d", "commit": ["x"], "dirty": False, "episodes_ran": 1},
           {"date": "d", "commit": "c" * 40, "dirty": "no", "episodes_ran": 1},
           {"date": "d", "commit": "c" * 40, "dirty": False, "episodes_ran": -100},
           {"date": "d", "commit": "c" * 40, "dirty": False, "episodes_ran": "3"},
           {"date": "d", "commit": "c" * 40, "dirty": False, "episodes_ran": True}]
    path = tmp_path / L.LEDGER_NAME
    path.write_text("\n".join(json.dumps(b) for b in bad) + '\n{"date": "d", "episodes_ran": 1e400}\n{"date": "d", "comm')
    L.record(tmp_path, 2, A)  # appended on a line of its own
    assert [(h["commit"], h["episodes_ran"]) for h in L.history(tmp_path)] == [("a" * 40, 2)]
    assert L.reuse_note(tmp_path, 2, A) is None


def test_a_dirty_flag_that_is_unknown_is_never_taken_for_clean(tmp_path):
    L.record(tmp_path, 1, {"commit": "a" * 40, "dirty": None})
    assert "uncommitted changes unknown" in L.reuse_note(tmp_path, 1, A)
