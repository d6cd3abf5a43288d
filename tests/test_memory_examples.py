"""ACT warm-up examples with a rehearsal memory in the prompt (`rehearsal.memory_examples`): the memory is
rendered as Private Rehearsal renders it, holds a faithful and/or misleading rehearsal of the task, and the
target is the gold turn all the same."""

from __future__ import annotations

import json
import re

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.envs.tau2.synth import gold_answer, synthesize
from envace_core.rehearsal.memory_examples import act_memory_examples
from envace_core.training.sft import SFTError, act_examples
from envace_core.training.transitions import TestSplitError


@pytest.fixture(scope="module")
def tasks():
    return [t for d in ("airline", "retail") for t in synthesize(d, 2, levels=[1, 2], seed=0)]


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


def notes(tok, ids) -> str:
    text = tok.decode(ids)
    assert "# Notes from rehearsal" in text
    return text.split("# Notes from rehearsal", 1)[1].split("<|im_end|>", 1)[0]


def test_every_act_turn_comes_with_a_memory_and_the_same_target(tasks, tok):
    plain = act_examples(tasks, tok, policy_max_chars=300)
    ex = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400)
    assert [(e.task_id, e.completion_ids, e.gold) for e in ex] == [(e.task_id, e.completion_ids, e.gold) for e in plain]
    by_task = {t.id: t for t in tasks}
    kinds = set()
    for e, p in zip(ex, plain):
        assert len(e.prompt_ids) > len(p.prompt_ids) and "# Notes from rehearsal" not in tok.decode(p.prompt_ids)
        m = notes(tok, e.prompt_ids)
        assert "[rehearsal 2]" in m and "Rehearsal 1:" in m  # two rehearsals, newest first, as memory_text orders
        first = by_task[e.task_id].gold_actions[0]
        calls = re.findall(r"- called (\w+)\((\{.*?\})\) -> (ERROR )?", m)
        assert calls and all(name == first.name for name, _, _ in calls[:1])
        for name, args, err in calls:
            same = json.loads(args) == first.arguments
            kinds.add("faithful" if same and not err else "imagined_error" if same else "wrong_call")
        if e.gold is None:
            assert e.text == gold_answer(by_task[e.task_id])
    assert kinds == {"faithful", "imagined_error", "wrong_call"}  # every kind occurs across the tasks
    # the same memory at every turn of a task (no re-entry: one m_x for the whole committed run)
    for tid in by_task:
        assert len({notes(tok, e.prompt_ids) for e in ex if e.task_id == tid}) == 1
    again = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400)
    assert [e.prompt_ids for e in again] == [e.prompt_ids for e in ex]
    other = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400, seed=5)
    assert [e.prompt_ids for e in other] != [e.prompt_ids for e in ex]


def test_calls_content_budget_and_bad_input(tasks, tok):
    ex = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400, memory_content="calls")
    assert all("told the user" not in notes(tok, e.prompt_ids) and "- ended:" not in notes(tok, e.prompt_ids)
               for e in ex)
    small = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=40)
    assert all(len(tok.encode(notes(tok, e.prompt_ids).strip(), add_special_tokens=False)) <= 40 for e in small)
    pit = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400, memory_content="pitfalls")
    texts = [tok.decode(e.prompt_ids) for e in pit]
    held = [notes(tok, e.prompt_ids) for e, t in zip(pit, texts) if "# Notes from rehearsal" in t]
    assert held and len(held) == len(pit)  # a task whose memory renders to nothing gets no repeated plain example
    for m in held:  # only failed calls: no successful one, no message, no ending
        calls = [line for line in m.splitlines() if line.startswith("- ")]
        assert calls and all(line.startswith("- called ") and "-> ERROR" in line for line in calls)
    with pytest.raises(SFTError, match="unknown rehearsal memory content 'plans'"):
        act_memory_examples(tasks, tok, memory_content="plans")
    with pytest.raises(TestSplitError):
        act_memory_examples([tasks[0].model_copy(update={"split": "test"})], tok, policy_max_chars=300)


def test_a_task_whose_memory_renders_to_nothing_gets_no_example(tasks, tok, monkeypatch):
    """Under "pitfalls" a faithful rehearsal renders to nothing; a task left with no memory must not come
    back as a second copy of its plain ACT examples."""
    import envace_core.rehearsal.memory_examples as me

    real = me.rehearsal_kinds
    monkeypatch.setattr(me, "rehearsal_kinds", lambda task, *a: {} if task.id == tasks[0].id else real(task, *a))
    ex = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400)
    assert {e.task_id for e in ex} == {t.id for t in tasks[1:]}


def test_wrong_call_memories_name_a_call_the_target_does_not_make(tasks, tok):
    """kinds=("wrong_call",) under "pitfalls": one rehearsal per task, its one failed call a wrong variant
    of the first gold call, never the call the first target makes; unknown or no kinds are refused."""
    from envace_core.rehearsal.memory_examples import KINDS

    ex = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400, memory_content="pitfalls",
                             kinds=("wrong_call",))
    assert ex
    by_task = {t.id: t for t in tasks}
    for e in ex:
        m = notes(tok, e.prompt_ids)
        calls = re.findall(r"- called (\w+)\((\{.*?\})\) -> ERROR ", m)
        assert "[rehearsal 2]" not in m and len(calls) == 1
        first = by_task[e.task_id].gold_actions[0]
        assert calls[0][0] == first.name and json.loads(calls[0][1]) != first.arguments
    default = act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400)
    assert [e.prompt_ids for e in act_memory_examples(tasks, tok, policy_max_chars=300, memory_max_tokens=400,
                                                      kinds=KINDS)] == [e.prompt_ids for e in default]
    for bad in ((), ("wrong_calls",)):
        with pytest.raises(SFTError, match="rehearsal kinds"):
            act_memory_examples(tasks, tok, kinds=bad)


def test_memory_kinds_config_is_checked():
    from envace_core.config import ConfigError, load_config
    from envace_core.config_checks import UnusedSettingWarning

    cfg = load_config("test", "train.sft_warmup_steps=2,train.sft_act_memory=true,train.sft_act_memory_kinds=[wrong_call]")
    assert cfg.train.sft_act_memory_kinds == ["wrong_call"]
    for bad in ("[wrong]", "[]", "[wrong_call,wrong_call]"):
        with pytest.raises(ConfigError, match="sft_act_memory_kinds"):
            load_config("test", f"train.sft_act_memory_kinds={bad}")
    with pytest.warns(UnusedSettingWarning, match="sft_act_memory_kinds.*no effect"):
        load_config("test", "train.sft_warmup_steps=2,train.sft_act_memory_kinds=[faithful]")


def test_memory_warmups_that_differ_from_test_time_warn():
    from envace_core.config import load_config
    from envace_core.config_checks import UnusedSettingWarning

    on = "train.sft_warmup_steps=2,train.sft_act_memory=true"
    with pytest.warns(UnusedSettingWarning, match=r"kinds=\[faithful\] adds no example"):
        load_config("test", f"{on},train.sft_act_memory_kinds=[faithful]")
    with pytest.warns(UnusedSettingWarning, match="render as 'calls'"):
        load_config("test", f"{on},rehearsal.memory_content=consensus")
