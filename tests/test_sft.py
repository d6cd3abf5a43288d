"""The supervised ACT warm-up (envace_core/training/sft.py): targets, prompts, loss, and the train-stage switch."""

from __future__ import annotations

from pathlib import Path

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
import envace_core.training.sft as sft_mod
from envace_core.config import TrainConfig
from envace_core.envs.tau2.synth import gold_answer, synthesize
from envace_core.envs.tau2.tasks import task_context
from envace_core.roles.act import act_messages, act_prompt_ids, parse_act
from envace_core.stages.curate import curate
from envace_core.stages.train import rollout_and_train
from envace_core.training.sft import SFTError, act_examples, sft_warmup


@pytest.fixture(scope="module")
def tasks():
    # one look-up (level 1) and one write (level 2) per domain: multi-call gold trajectories included
    return [t for d in ("airline", "retail") for t in synthesize(d, 2, levels=[1, 2], seed=0)]


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


@pytest.fixture(scope="module")
def examples(tasks, tok):
    return act_examples(tasks, tok, policy_max_chars=300)


def test_targets_parse_back_to_the_gold_calls(tasks, examples):
    by_task = {t.id: t for t in tasks}
    assert len(examples) == sum(len(t.gold_actions) + 1 for t in tasks)
    for t in tasks:
        ex = [e for e in examples if e.task_id == t.id]
        calls = [e.gold for e in ex[:-1]]
        assert [(c.name, c.arguments) for c in calls] == [(a.name, a.arguments) for a in t.gold_actions]
        assert ex[-1].gold is None and ex[-1].text == gold_answer(t)
    for e in examples:
        out = parse_act(e.text, task_context(by_task[e.task_id], 300).tools, strict=True)
        if e.gold is None:
            assert out.tool_call is None and out.message == e.text.strip()
        else:
            assert (out.tool_call.name, out.tool_call.arguments) == (e.gold.name, e.gold.arguments)


def test_turn_and_length_limits(tasks, examples, tok):
    """max_turns keeps only the turns a rollout can reach (no answer turn when the gold needs them all);
    max_tokens drops long examples instead of exhausting memory."""
    one = act_examples(tasks, tok, policy_max_chars=300, max_turns=1)
    assert len(one) == sum(1 + (len(t.gold_actions) == 0) for t in tasks if t.gold_actions)
    assert all(e.gold is not None for e in one)  # every task has >= 1 gold call: the answer is turn >= 2
    assert [e.text for e in one] == [next(x for x in examples if x.task_id == e.task_id).text for e in one]
    lengths = sorted(len(e.prompt_ids) + len(e.completion_ids) for e in examples)
    cut = lengths[len(lengths) // 2]
    short = act_examples(tasks, tok, policy_max_chars=300, max_tokens=cut)
    assert short and len(short) < len(examples)
    assert all(len(e.prompt_ids) + len(e.completion_ids) <= cut for e in short)


def test_prompt_and_target_ids_are_the_chat_template_conversation(tasks, examples, tok):
    """prompt ids = the rollout's ACT prompt; prompt + target = the template's rendering of the turn
    (up to the template's newline after <|im_end|>, which the engine never samples)."""
    t = next(t for t in tasks if len(t.gold_actions) > 1)
    ex = [e for e in examples if e.task_id == t.id]
    ctx = task_context(t, 300)
    from envace_core.types import Message

    history = [Message(role="user", content=t.first_user_message)]
    assert ex[0].prompt_ids == act_prompt_ids(tok, ctx, history)
    second = ex[1]
    assert len(second.prompt_ids) > len(ex[0].prompt_ids) + len(ex[0].completion_ids)  # call + real result
    assert second.prompt_ids[:len(ex[0].prompt_ids) + len(ex[0].completion_ids)] == \
        ex[0].prompt_ids + ex[0].completion_ids
    for e in examples:
        assert e.completion_ids[-1] == tok.eos_token_id
        assert tok.decode(e.completion_ids, skip_special_tokens=True) == e.text
        msgs = act_messages(ctx, history) if e is ex[0] else None
        if msgs is not None:
            full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": e.text}], tokenize=True,
                                           return_dict=False)
            assert list(full[:len(e.prompt_ids) + len(e.completion_ids)]) == e.prompt_ids + e.completion_ids


def test_warmup_loss_decreases_on_a_fixed_set(examples, tiny_model_dir):
    import torch

    from envace_core.models import load_model, load_tokenizer
    from envace_core.training.trainer import PolicyTrainer

    # all linear layers: the random 64-wide model needs the capacity to fit its targets in a few steps
    cfg = TrainConfig(lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    trainer = PolicyTrainer(load_model(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)), cfg,
                            compute_dtype="float32")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    fixed = examples[:2]
    losses = sft_warmup(trainer, fixed, steps=12, learning_rate=1e-2, batch_rows=2, seed=0)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    # same 2 examples every step: the fit must improve (~0.9 nats here from the uniform ~10.8; a loop
    # that skipped the update or trained on prompt tokens would not move the completion CE like this)
    assert losses[-1] < losses[0] - 0.5 and sum(losses[-4:]) < sum(losses[:4]), losses
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)  # only the adapter moved
    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad for p in base)


def test_empty_set_is_a_clear_error():
    with pytest.raises(SFTError, match="synthetic_tasks_per_domain"):
        sft_warmup(None, [], steps=1, learning_rate=1e-4, batch_rows=1)


def test_config_defaults_and_bounds():
    c = TrainConfig()
    assert (c.sft_warmup_steps, c.sft_learning_rate, c.sft_batch_rows) == (0, 1e-4, 4)
    from pydantic import ValidationError

    for bad in ({"sft_warmup_steps": -1}, {"sft_learning_rate": 0}, {"sft_batch_rows": 0}):
        with pytest.raises(ValidationError):
            TrainConfig(**bad)


def _cfg(model_dir, root, steps):
    from envace_core.config import load_config

    return load_config("test", {
        "model": {"ref": str(model_dir), "compute_dtype": "float32"},
        "data": {"synthetic_tasks_per_domain": 1, "synthetic_levels": [1]},  # tau2's first has no gold
        "train": {"sft_warmup_steps": steps, "sft_batch_rows": 1},
        "store": {"root": str(Path(root) / "store"), "registry": str(Path(root) / "registry")}})


def test_train_stage_runs_warmup_only_when_asked_and_only_on_a_fresh_run(tiny_model_dir, tmp_path, monkeypatch):
    from envace_core.training.sft import sft_warmup

    calls = []
    real = sft_warmup
    monkeypatch.setattr(sft_mod, 'sft_warmup', lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    ds = curate(_cfg(tiny_model_dir, tmp_path / "a", 0))
    rollout_and_train(_cfg(tiny_model_dir, tmp_path / "a", 0), ds)
    assert calls == []  # default: no warm-up
    rollout_and_train(_cfg(tiny_model_dir, tmp_path / "b", 2), ds)
    assert calls == [2]
    rollout_and_train(_cfg(tiny_model_dir, tmp_path / "b", 2), ds)  # resumes: checkpoint has it
    assert calls == [2]
