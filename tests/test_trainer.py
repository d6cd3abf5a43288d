"""PolicyTrainer on the tiny random Llama: exact ids, gradient accumulation, frozen roles, adapters."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from envace_core.config import TrainConfig
from envace_core.models import load_model, load_tokenizer
from envace_core.training.rows import TrainingRow
from envace_core.training.trainer import AdapterLoadError, PolicyTrainer
from envace_core.types import Generation, Role


def make_trainer(model_dir, compute_dtype="float32", lora_b_seed=123, **cfg):
    cfg.setdefault("max_grad_norm", 1e6)  # no clipping unless a test asks for it
    trainer = PolicyTrainer(load_model(model_dir), load_tokenizer(model_dir), TrainConfig(**cfg),
                            compute_dtype=compute_dtype)
    if lora_b_seed is not None:  # non-zero B so the adapters change the function (B = 0 at init)
        g = torch.Generator().manual_seed(lora_b_seed)
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return trainer


def make_rows(n=6, seed=0, role="act", vocab=2000, shared=True):
    """Ragged rows. shared=True: a 20-token system prefix common to all rows and one prompt per pair
    of rows (a GRPO group), so micro-batches take the shared-prefix path; False: unrelated prompts."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, vocab, (20,), generator=g).tolist()
    rows = []
    for i in range(n):
        if shared:
            prompt = system + torch.randint(1, vocab, (3 + 4 * (i // 2) % 9,),
                                            generator=torch.Generator().manual_seed(seed * 100 + i // 2)).tolist()
        else:
            prompt = torch.randint(1, vocab, (5 + 3 * i % 7,), generator=g).tolist()
        C = 2 + (5 * i) % 6  # ragged completions
        rows.append(TrainingRow(
            role=role, prompt_ids=prompt, completion_ids=torch.randint(1, vocab, (C,), generator=g).tolist(),
            old_logprobs=[0.0] * C, advantage=float(torch.randn((), generator=g)),
            temperature=[1.0, 0.7, 1.3][i % 3]))
    return rows


def on_policy(trainer, rows):
    """Rows whose old_logprobs are the current policy's (ratio 1 at the start of the step)."""
    lps = trainer.completion_logprobs(rows)
    return [TrainingRow(r.role, r.prompt_ids, r.completion_ids, lp, r.advantage, r.temperature)
            for r, lp in zip(rows, lps)]


def capture_grads(trainer):
    grads = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.append([p.grad.detach().clone() for p in trainer._params]))
    return grads


def test_from_generation_keeps_exact_ids():
    gen = Generation(role=Role.REHEARSE, prompt_ids=[1, 2], completion_ids=[3, 4, 5],
                     logprobs=[-0.1, -0.2, -0.3], temperature=0.8)
    row = TrainingRow.from_generation(gen, 0.5)
    assert (row.role, row.prompt_ids, row.completion_ids, row.old_logprobs, row.advantage,
            row.temperature) == ("rehearse", [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], 0.5, 0.8)
    assert row.prompt_ids is not gen.prompt_ids  # a copy: the trajectory is written out unchanged


@pytest.mark.parametrize("shared", [True, False])
def test_completion_logprobs_equal_a_direct_forward(tiny_model_dir, shared):
    trainer = make_trainer(tiny_model_dir, micro_batch_rows=4)
    rows = make_rows(7, shared=shared)
    got = trainer.completion_logprobs(rows)
    with torch.no_grad():
        for r, lp in zip(rows, got):
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = trainer.model(input_ids=ids).logits[0]
            P, C = len(r.prompt_ids), len(r.completion_ids)
            want = torch.log_softmax(logits[P - 1:P + C - 1] / r.temperature, -1)
            want = want.gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            assert len(lp) == C
            assert torch.allclose(torch.tensor(lp), want, atol=1e-5)
    trainer.min_shared_prefix = 10 ** 9  # the plain padded batch gives the same numbers
    for a, b in zip(trainer.completion_logprobs(rows), got):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    # the adapters are active in that computation (not the base model's numbers)
    with trainer.model.disable_adapter():
        base = trainer.completion_logprobs(rows)
    assert not torch.allclose(torch.tensor(base[0]), torch.tensor(got[0]), atol=1e-3)


def test_positive_advantage_raises_the_rows_logprob(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, learning_rate=1e-2, lora_b_seed=None)
    row = on_policy(trainer, make_rows(1))[0]
    row.advantage = 1.0
    before = sum(row.old_logprobs)
    m = trainer.step([row])
    after = sum(trainer.completion_logprobs([row])[0])
    assert after > before + 1e-3
    assert m["loss"] == pytest.approx(-1.0, abs=1e-5)  # ratio 1: loss = -A
    assert m["clip_frac"] == 0.0 and m["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["rows"] == 1 and m["tokens"] == len(row.completion_ids) and m["entropy"] > 0
    assert all(p.dtype == torch.float32 for p in trainer._params)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gradient_accumulation_equals_one_big_batch(tiny_model_dir, agg):
    results = []
    for mbr in (1, 4, 8):
        trainer = make_trainer(tiny_model_dir, micro_batch_rows=mbr, loss_agg=agg)
        rows = on_policy(trainer, make_rows(6))
        for r in rows:  # off-policy a bit so ratios and clipping are not trivial
            r.old_logprobs = [x + 0.3 * ((i % 3) - 1) for i, x in enumerate(r.old_logprobs)]
        grads = capture_grads(trainer)
        m = trainer.step(rows)
        results.append((m, grads[0]))
    (m1, g1), *others = results
    for m, g in others:
        assert m["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
        assert m["clip_frac"] == pytest.approx(m1["clip_frac"])
        assert m["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        for a, b in zip(g1, g):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert m1["clip_frac"] > 0 and m1["grad_norm"] > 0


def test_frozen_role_invalid_and_empty_rows_are_ignored(tiny_model_dir):
    act = make_rows(3, seed=1)
    user = make_rows(3, seed=2, role="user")
    for r in user:
        r.advantage = 10.0
    empty = TrainingRow("act", [1, 2, 3], [], [], 5.0)
    failed = TrainingRow("act", [1, 2, 3], [4, 5], [0.0, 0.0], 5.0, valid=False)  # reward None: masked
    grads = []
    for rows in (act, act + user + [empty, failed]):
        trainer = make_trainer(tiny_model_dir, trained_roles=["act"])
        captured = capture_grads(trainer)
        m = trainer.step(rows)
        grads.append(captured[0])
    assert m["rows"] == 3 and m["rows_skipped"] == 5 and m["tokens"] == sum(len(r.completion_ids) for r in act)
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no trainable row.*1 invalid"):
        trainer.step(user + [empty, failed])
    assert trainer.update([failed])["optimizer_steps"] == 0


def test_kl_to_reference_uses_the_disabled_adapter(tiny_model_dir):
    rows = make_rows(3)
    trainer = make_trainer(tiny_model_dir, kl_beta=0.1, lora_b_seed=None)  # B = 0: policy == reference
    m = trainer.step(on_policy(trainer, rows))
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    trainer = make_trainer(tiny_model_dir, kl_beta=0.1)
    m = trainer.step(on_policy(trainer, rows))
    assert m["kl_ref"] > 1e-3
    # the adapters are enabled again after the reference forward
    after = trainer.completion_logprobs(rows)
    with trainer.model.disable_adapter():
        base = trainer.completion_logprobs(rows)
    assert not torch.allclose(torch.tensor(after[0]), torch.tensor(base[0]), atol=1e-3)


def test_bf16_compute_keeps_fp32_master_weights_and_close_logprobs(tiny_model_dir):
    rows = make_rows(4)
    fp32 = make_trainer(tiny_model_dir).completion_logprobs(rows)
    trainer = make_trainer(tiny_model_dir, compute_dtype="bfloat16")
    bf16 = trainer.completion_logprobs(rows)
    for a, b in zip(fp32, bf16):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=0.05)
    m = trainer.step(on_policy(trainer, rows))
    assert m["grad_norm"] > 0 and all(p.dtype == torch.float32 for p in trainer._params)
    with pytest.raises(ValueError, match="compute_dtype"):
        PolicyTrainer(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), TrainConfig(),
                      compute_dtype="float16")


def test_save_and_load_adapter_round_trip(tiny_model_dir, tmp_path):
    rows = make_rows(3)
    trainer = make_trainer(tiny_model_dir, learning_rate=1e-2)
    saved = trainer.completion_logprobs(rows)
    out = tmp_path / "ckpt" / "adapter"
    trainer.save_adapter(str(out))
    trainer.save_adapter(str(out))  # overwriting an existing adapter works
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]  # no temp leftovers
    trainer.step(on_policy(trainer, rows))
    moved = trainer.completion_logprobs(rows)
    assert not torch.allclose(torch.tensor(moved[0]), torch.tensor(saved[0]), atol=1e-4)
    trainer.load_adapter(str(out))
    for a, b in zip(trainer.completion_logprobs(rows), saved):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
    # into a fresh trainer (another process would do this)
    fresh = make_trainer(tiny_model_dir, lora_b_seed=None)
    fresh.load_adapter(str(out))
    for a, b in zip(fresh.completion_logprobs(rows), saved):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


def test_load_adapter_errors_are_clear(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir)
    with pytest.raises(AdapterLoadError, match="missing"):
        trainer.load_adapter(str(tmp_path / "nope"))
    out = tmp_path / "adapter"
    trainer.save_adapter(str(out))
    (out / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(AdapterLoadError, match="corrupt"):
        trainer.load_adapter(str(out))
    other = make_trainer(tiny_model_dir, lora_r=4)
    other.save_adapter(str(out))
    with pytest.raises(AdapterLoadError, match="r, alpha"):
        trainer.load_adapter(str(out))


def test_micro_batches_keep_groups_together(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, micro_batch_rows=8, lora_b_seed=None)
    system = list(range(100, 140))
    rows = [TrainingRow("act", system + [7 + g] * 30, [1, 2], [0.0, 0.0], 0.0) for g in (1, 0, 1, 0, 1, 0)]
    chunks = trainer._micro_batches(rows)
    assert sorted(sorted(c) for c in chunks) == [[0, 2, 4], [1, 3, 5]]  # split at the group boundary
    unrelated = [TrainingRow("act", [i] * 5, [1], [0.0], 0.0) for i in range(1, 7)]
    trainer.cfg.micro_batch_rows = 4
    assert [len(c) for c in trainer._micro_batches(unrelated)] == [4, 2]
    # a turn-1 row and the turn-3 rows that extend its prompt by a long history: adjacent in prompt
    # order, yet kept apart (else every row's logits span the history)
    turn1 = TrainingRow("act", system, [1, 2], [0.0, 0.0], 0.0)
    turn3 = [TrainingRow("act", system + [9] * (trainer.max_prompt_spread + 1) + [k], [1], [0.0], 0.0)
             for k in range(3)]
    assert sorted(sorted(c) for c in trainer._micro_batches([turn1] + turn3)) == [[0], [1, 2, 3]]
    near = TrainingRow("act", system + [9] * 8, [1], [0.0], 0.0)  # within the spread: one batch
    assert [len(c) for c in trainer._micro_batches([turn1, near])] == [2]
    # the token budget counts a common prefix shorter than min_shared_prefix as run by every row
    trainer.cfg.micro_batch_tokens = 20  # short: 2 × 17 tokens counted; shared: 2 × 6
    short = [TrainingRow("act", [3] * (trainer.min_shared_prefix - 5) + [k], [1] * 5, [0.0] * 5, 0.0) for k in (4, 5)]
    assert [len(c) for c in trainer._micro_batches(short)] == [1, 1]
    shared = [TrainingRow("act", [3] * (trainer.min_shared_prefix + 5) + [k], [1] * 5, [0.0] * 5, 0.0) for k in (4, 5)]
    assert [len(c) for c in trainer._micro_batches(shared)] == [2]


def test_a_micro_batch_stops_at_its_token_budget_and_the_gradient_stays(tiny_model_dir):
    """B × (longest prompt + completion − common prefix) is bounded: a row with a long completion is not
    padded into its neighbours' micro-batch; one row always fits; the step's gradient does not change."""
    results = []
    for budget in (None, 40):
        trainer = make_trainer(tiny_model_dir, micro_batch_rows=4, micro_batch_tokens=budget)
        group = make_rows(4, seed=3)  # one GRPO group: the same prompt, completions of 2 to 30 tokens
        rows = [TrainingRow("act", group[0].prompt_ids, r.completion_ids, r.old_logprobs, r.advantage)
                for r in group[:3]] + [TrainingRow("act", group[0].prompt_ids, list(range(5, 35)), [0.0] * 30, 1.0)]
        rows = on_policy(trainer, rows)
        prefix = len(rows[0].prompt_ids) - 1  # where the first completion token's logits start
        chunks = trainer._micro_batches(rows)
        for c in chunks:
            cost = len(c) * (max(len(rows[i].prompt_ids) + len(rows[i].completion_ids) for i in c) - prefix)
            assert budget is None or len(c) == 1 or cost <= budget
        grads = capture_grads(trainer)
        results.append(([len(c) for c in chunks], trainer.step(rows), grads))
    assert results[0][0] == [4] and len(results[1][0]) > 1
    for a, b in zip(results[0][2][0], results[1][2][0]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert results[1][1]["loss"] == pytest.approx(results[0][1]["loss"], rel=1e-5, abs=1e-7)


# --- the update: PPO epochs, mini-batches, LR schedule, clipping -------------------------------

def test_update_runs_ppo_epochs_over_shuffled_mini_batches(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, ppo_epochs=2, mini_batch_rows=2, learning_rate=1e-2)
    rows = on_policy(trainer, make_rows(5))
    seen, real_step = [], trainer.step
    trainer.step = lambda batch: seen.append([rows.index(r) for r in batch]) or real_step(batch)
    m = trainer.update(rows + [TrainingRow("user", [1, 2], [3], [0.0], 1.0)])  # a frozen role
    assert [len(b) for b in seen] == [2, 2, 1, 2, 2, 1] and m["optimizer_steps"] == 6
    for epoch in (seen[:3], seen[3:]):  # every row once per epoch
        assert sorted(i for b in epoch for i in b) == [0, 1, 2, 3, 4]
    assert seen[:3] != seen[3:]  # reshuffled for the second epoch
    assert (m["rows"], m["rows_skipped"], m["epochs"], m["lr"]) == (5, 1, 2, 1e-2)
    assert m["tokens"] == sum(len(r.completion_ids) for r in rows)
    # later steps are off-policy w.r.t. the fixed rollout log-probs: the ratio moves, PPO clips
    assert m["approx_kl"] > 0 and m["grad_norm_max"] >= m["grad_norm"] > 0
    assert trainer.updates == 1 and trainer.optimizer_steps == 6


def test_one_epoch_one_mini_batch_update_is_exactly_one_step(tiny_model_dir):
    a, b = make_trainer(tiny_model_dir, learning_rate=1e-2), make_trainer(tiny_model_dir, learning_rate=1e-2)
    rows = on_policy(a, make_rows(4))
    ma, mb = a.update(rows), b.step(rows)
    assert ma["loss"] == mb["loss"] and ma["optimizer_steps"] == 1
    assert all(torch.equal(p, q) for p, q in zip(a._params, b._params))


@pytest.mark.parametrize("schedule, warmup, want", [
    ("constant", 0, [1, 1, 1, 1]),
    ("constant", 2, [0, 0.5, 1, 1]),
    ("linear", 1, [0, 1, 2 / 3, 1 / 3]),
    ("cosine", 0, [1, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]),
])
def test_lr_schedule_steps_once_per_iteration(tiny_model_dir, schedule, warmup, want):
    trainer = make_trainer(tiny_model_dir, lr_scheduler=schedule, warmup_iterations=warmup, iterations=4,
                           learning_rate=0.1, trained_roles=["act"])
    frozen = [TrainingRow("rehearse", [1, 2], [3], [0.0], 1.0)]  # no step: only the schedule moves
    got = []
    for _ in want:
        got.append(trainer.optimizer.param_groups[0]["lr"])
        m = trainer.update(frozen)
        assert m["lr"] == got[-1] and m["optimizer_steps"] == 0
    assert got == pytest.approx([0.1 * w for w in want])


def test_config_rejects_warmup_as_long_as_training():
    from envace_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="warmup_iterations"):
        load_config("test", {"train": {"iterations": 2, "warmup_iterations": 2}})


def test_gradients_are_clipped_to_max_grad_norm(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, max_grad_norm=1e-3)
    grads = capture_grads(trainer)
    m = trainer.step(on_policy(trainer, make_rows(4)))
    clipped = torch.sqrt(sum((g.float() ** 2).sum() for g in grads[0]))
    assert m["grad_norm"] > 1e-2 and clipped == pytest.approx(1e-3, rel=1e-4)


# --- token-in/token-out: chat-template ids and the behaviour policy ------------------------------

def _im(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_multi_turn_ids_equal_the_chat_template_up_to_the_newline_after_end_of_turn(tiny_model_dir):
    """For a canonical tool call, each ACT row's prompt + completion is a prefix of the next ACT
    prompt, and the last row's ids equal the template's ids for the whole conversation. The one
    controlled difference: the engine stops on <|im_end|> (eos) while the template writes
    "<|im_end|>\\n"; that "\\n" is context (no loss), present in the next prompt and absent from the
    completion."""
    from envace_core.envs.tau2.tasks import load_tasks, task_context
    from envace_core.roles.act import act_messages
    from envace_core.roles.tools import format_tool_call
    from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
    from tests.scripted import ScriptedEngine

    tok = load_tokenizer(tiny_model_dir)
    task = next(t for t in load_tasks("airline", "test") if t.gold_actions)
    call = format_tool_call(task.gold_actions[0])
    engine = ScriptedEngine(tok, [call, "Done, anything else?"], rehearse_text='{"status": "ok"}')
    p = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    ctx = task_context(task, 300)
    traj = rehearsal_rollouts(engine, ctx, 1, p, seed=0)[0]
    act1, reh, act2 = traj.generations
    assert (act1.role, reh.role, act2.role) == (Role.ACT, Role.REHEARSE, Role.ACT)
    first = act1.prompt_ids + act1.completion_ids
    assert act1.completion_ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert act2.prompt_ids[:len(first)] == first
    assert act2.prompt_ids[len(first):len(first) + 1] == _im(tok, "\n")  # the controlled difference
    # the inserted context is the template's rendering of the (rehearsed) tool message
    history = [{"role": "user", "content": ctx.first_user_message},
               {"role": "assistant", "content": call},
               {"role": "tool", "content": '{"status":"ok"}'},  # the canonical rendering of the rehearsed result
               {"role": "assistant", "content": "Done, anything else?"}]
    system = act_messages(ctx, [])[0]
    whole = tok.apply_chat_template([system, *history], tokenize=True, return_dict=False)
    assert act2.prompt_ids + act2.completion_ids + _im(tok, "\n") == list(whole)
    # training rows carry exactly these ids; each row's old log-probs are its rollout log-probs
    for g in traj.generations:
        r = TrainingRow.from_generation(g, 1.0)
        assert (r.prompt_ids, r.completion_ids, r.old_logprobs) == (g.prompt_ids, g.completion_ids, g.logprobs)


def test_a_non_canonical_call_is_re_rendered_in_the_next_prompt_only(tiny_model_dir):
    """Controlled difference 2: the history shows the parsed call in canonical form, not the raw
    sampled text. Rows are not affected: row t trains on exactly the ids sampled at turn t given
    exactly the prompt ids it was sampled from."""
    from envace_core.envs.tau2.tasks import load_tasks, task_context
    from envace_core.roles.tools import format_tool_call
    from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
    from tests.scripted import ScriptedEngine

    tok = load_tokenizer(tiny_model_dir)
    task = next(t for t in load_tasks("airline", "test") if t.gold_actions)
    gold = task.gold_actions[0]
    args = json.dumps(gold.arguments, separators=(",", ":"))
    raw = f'<tool_call>{{"name":"{gold.name}","arguments":{args}}}</tool_call>'
    assert raw != format_tool_call(gold)
    engine = ScriptedEngine(tok, [raw, "Done."])
    p = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    act1, _, act2 = rehearsal_rollouts(engine, task_context(task, 300), 1, p, seed=0)[0].generations
    assert act1.completion_ids == _im(tok, raw) + [tok.eos_token_id]
    text2 = tok.decode(act2.prompt_ids)
    assert format_tool_call(gold) in text2 and raw not in text2


def test_rollout_logprobs_are_the_behaviour_policy_of_the_loss(tiny_model_dir):
    """Rows built from HFEngine generations: at the first step the ratio is exp(logp - rollout logp)
    = 1 (engine and trainer agree); shifting the recorded log-probs by d moves it to exp(-d), so the
    loss's old log-probs are the rollout's, not recomputed."""
    from envace_core.engines.hf import HFEngine
    from envace_core.envs.tau2.tasks import load_tasks, task_context
    from envace_core.training.rollout import RolloutParams, rehearsal_rollouts

    trainer = make_trainer(tiny_model_dir)
    engine = HFEngine(trainer.model, trainer.tokenizer, compute_dtype="float32")
    task = load_tasks("airline", "train", limit=1)[0]
    p = RolloutParams(max_turns=1, max_new_tokens_act=6, max_new_tokens_rehearse=6, temperature=0.9)
    gens = [g for t in rehearsal_rollouts(engine, task_context(task, 300), 2, p, seed=3) for g in t.generations]
    rows = [TrainingRow.from_generation(g, 1.0) for g in gens]
    m = trainer.step(rows)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    shifted = [TrainingRow(r.role, r.prompt_ids, r.completion_ids, [x + 0.5 for x in r.old_logprobs],
                           r.advantage, r.temperature) for r in rows]
    m = make_trainer(tiny_model_dir).step(shifted)
    assert m["ratio_mean"] == pytest.approx(math.exp(-0.5), rel=1e-3)


# --- per-role policy (two LoRA adapters) --------------------------------------------------------

def _adapter_state(trainer):
    return {n: [p.detach().clone() for p in ps] for n, ps in trainer._adapter_params.items()}


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_per_role_adapters_each_learn_only_from_their_own_rows(tiny_model_dir):
    kw = {"policy_per_role": True, "learning_rate": 1e-2, "max_grad_norm": 0.05}
    act, reh = make_rows(4, seed=1), make_rows(4, seed=2, role="rehearse")
    user = make_rows(2, seed=3, role="user")
    results = {}
    for name, rows in (("act", act), ("rehearse", reh), ("both", act + reh), ("user", user)):
        trainer = make_trainer(tiny_model_dir, trained_roles=["act", "rehearse", "user"], **kw)
        assert sorted(trainer.model.peft_config) == ["act", "rehearse"]
        before = _adapter_state(trainer)
        trainer.step(on_policy(trainer, rows))
        results[name] = (before, _adapter_state(trainer))
    for name, other in (("act", "rehearse"), ("rehearse", "act"), ("user", "act")):
        before, after = results[name]
        assert _same(before[other], after[other])  # untouched by the other role's rows
        assert not _same(before[ADAPTER[name]], after[ADAPTER[name]])
    # a mixed step = two separate policies' steps (own loss normalisation, own gradient clipping)
    for name in ("act", "rehearse"):
        for x, y in zip(results["both"][1][name], results[name][1][name]):
            assert torch.allclose(x, y, atol=1e-7)
    # trained_roles freezes a role: its rows do not move its adapter
    trainer = make_trainer(tiny_model_dir, trained_roles=["act"], **kw)
    before = _adapter_state(trainer)
    m = trainer.step(on_policy(trainer, act + reh))
    assert m["rows_skipped"] == 4 and _same(before["rehearse"], _adapter_state(trainer)["rehearse"])


ADAPTER = {"act": "act", "rehearse": "rehearse", "user": "rehearse"}


def test_engine_generates_each_role_with_its_adapter_and_reloads(tiny_model_dir, tmp_path):
    from envace_core.config import load_config
    from envace_core.engines.base import SamplingParams
    from envace_core.engines.hf import HFEngine
    from envace_core.training.policy import load_policy

    trainer = make_trainer(tiny_model_dir, policy_per_role=True)
    with torch.no_grad():  # make the two adapters differ (make_trainer used one stream for both)
        for p in trainer._adapter_params["rehearse"]:
            p.mul_(-1.5)
    engine = HFEngine(trainer.model, trainer.tokenizer, compute_dtype="float32")
    prompt = make_rows(1)[0].prompt_ids

    def sample(eng, role):
        c = eng.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0.0, role=role))[0][0]
        return c.token_ids, c.logprobs

    out = {role: sample(engine, role) for role in ("act", "rehearse", "user", None)}
    assert trainer.model.active_adapter == "act"  # restored after each call
    for role in ("act", "rehearse"):
        ids, lps = out[role]
        lp = trainer.completion_logprobs([TrainingRow(role, prompt, ids, lps, 0.0)])[0]
        assert lp == pytest.approx(lps, abs=1e-4)  # trainer scores a row with its role's adapter
    assert out["act"][1] != pytest.approx(out["rehearse"][1], abs=1e-3)
    assert out["user"] == out["rehearse"] and out[None] == out["act"]
    # saved as act/ + rehearse/; stages.load_policy restores the per-role policy
    trainer.save_adapter(str(tmp_path / "adapter"))
    assert {p.name for p in (tmp_path / "adapter").iterdir() if p.is_dir()} == {"act", "rehearse"}
    cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"}})
    model, tok, _ = load_policy(cfg, str(tmp_path / "adapter"))
    again = HFEngine(model, tok, compute_dtype="float32")
    for role in ("act", "rehearse"):
        assert sample(again, role)[0] == out[role][0]
        assert sample(again, role)[1] == pytest.approx(out[role][1], abs=1e-5)
    fresh = make_trainer(tiny_model_dir, policy_per_role=True, lora_b_seed=None)
    fresh.load_adapter(str(tmp_path / "adapter"))
    for a, b in zip(fresh._params, trainer._params):
        assert torch.equal(a, b)
    with pytest.raises(AdapterLoadError, match="missing"):
        make_trainer(tiny_model_dir).load_adapter(str(tmp_path / "adapter"))  # shared vs per-role


def _rows_with_system(trainer, system_tokens=150, n=6):
    g = torch.Generator().manual_seed(7)
    system = torch.randint(1, 2000, (system_tokens,), generator=g).tolist()
    rows = []
    for i in range(n):  # three GRPO groups of two rows behind one long system message
        prompt = system + torch.randint(1, 2000, (4 + 3 * (i // 2),), generator=torch.Generator().manual_seed(i // 2)).tolist()
        C = 2 + (3 * i) % 5
        rows.append(TrainingRow("act", prompt, torch.randint(1, 2000, (C,), generator=g).tolist(), [0.0] * C,
                                float(torch.randn((), generator=g)), 1.0))
    return on_policy(trainer, rows)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_a_system_message_shared_across_micro_batches_runs_once_with_the_same_gradient(tiny_model_dir, dtype, tol):
    from envace_core.training.prefix_grad import SharedRoot

    grads, losses, root_calls, root_forwards = [], [], [], []
    forward = SharedRoot._forward

    def counted(root):
        root_forwards[-1] += 1
        return forward(root)

    for share, recompute in ((False, False), (True, False), (True, True)):
        trainer = make_trainer(tiny_model_dir, compute_dtype=dtype, micro_batch_rows=2,
                               recompute_shared_root=recompute)
        rows = _rows_with_system(trainer)
        if not share:
            trainer._root_clusters = lambda rows, mbs: [([k], 0) for k in range(len(mbs))]
        clusters = trainer._root_clusters(rows, trainer._micro_batches(rows))
        root_calls.append([r for _, r in clusters])
        got = capture_grads(trainer)
        root_forwards.append(0)
        SharedRoot._forward = counted
        try:
            losses.append(trainer.step(rows)["loss"])
        finally:
            SharedRoot._forward = forward
        grads.append(got[0])
    assert root_calls == [[0, 0, 0], [150], [150]]  # three micro-batches, one root of the 150 shared tokens
    assert root_forwards == [0, 1, 2]  # recomputed: the root's forward ran again before its backward
    for k in (1, 2):  # held root graph, recomputed root: the gradient of the plain computation
        assert losses[k] == pytest.approx(losses[0], rel=tol)
        for a, b in zip(grads[0], grads[k]):
            assert torch.allclose(a, b, rtol=tol, atol=tol * 1e-2), (a - b).abs().max()
    assert sum(float(a.abs().sum()) for a in grads[2]) > 0


def test_a_recomputed_root_holds_no_graph_until_its_backward(tiny_model_dir):
    from envace_core.training.prefix_grad import SharedRoot

    trainer = make_trainer(tiny_model_dir)
    ids = torch.randint(1, 2000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    args = (trainer._backbone, trainer._cache_kw, ids, trainer.device)
    held, recomputed = SharedRoot(*args), SharedRoot(*args, recompute=True)
    assert recomputed.recompute and not recomputed._kv  # only keys/values, no activations
    assert all(t.grad_fn is not None for t in held._kv[2:])  # the held root keeps its graph
    for a, b in zip(held.cache().layers, recomputed.cache().layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    suffix = torch.tensor([ids[:7]])
    grads = []
    for root in (held, recomputed):  # one suffix on the root's cache, then the root's backward
        trainer.model.zero_grad(set_to_none=True)
        h = trainer._backbone(input_ids=suffix, use_cache=True, **{trainer._cache_kw: root.cache()})
        h.last_hidden_state.pow(2).mean().backward()
        root.backward()
        grads.append([p.grad.clone() for p in params])
    assert not recomputed._kv  # the recomputed graph is freed by its backward
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    assert sum(float(g.abs().sum()) for g in grads[1]) > 0
    trainer._backbone.train()
    assert SharedRoot(*args, recompute=True).recompute  # dropout rates 0: the forward is deterministic
    trainer._backbone.config.attention_dropout = 0.1  # would draw other masks the second time
    assert not SharedRoot(*args, recompute=True).recompute


def test_root_clusters_group_consecutive_micro_batches_by_their_shared_prefix():
    from envace_core.training.prefix_grad import root_clusters

    sys_a, sys_b = list(range(1, 201)), list(range(1000, 1200))
    mbs = [[sys_a + [1, 2], sys_a + [1, 3]], [sys_a + [5]], [sys_b + [9], sys_b + [9, 9]], [sys_b + [4]], [[7, 7]]]
    assert root_clusters(mbs) == [([0, 1], 200), ([2, 3], 200), ([4], 0)]
    # a prompt that is all root keeps one token for its own forward; a short root is not shared
    assert root_clusters([[sys_a], [sys_a + [3]]]) == [([0, 1], 199)]
    assert root_clusters([[sys_a[:100] + [1]], [sys_a[:100] + [2]]]) == [([0], 0), ([1], 0)]
    with pytest.raises(ValueError, match="micro-batch 0 has no row"):
        root_clusters([[]])


def test_grouped_key_value_heads_give_the_repeated_heads_gradient(tiny_model_dir, monkeypatch):
    from envace_core.training.attention import FORCE_GQA

    sdpa = torch.nn.functional.scaled_dot_product_attention
    grads, sft, grouped = [], [], []

    def spy(*a, **kw):
        grouped.append(bool(kw.get("enable_gqa")))
        return sdpa(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    for user_value in ("0", None):  # a user's "0" keeps transformers' repeated heads; unset: grouped on CPU
        if user_value is None:
            monkeypatch.delenv(FORCE_GQA, raising=False)
        else:
            monkeypatch.setenv(FORCE_GQA, user_value)
        trainer = make_trainer(tiny_model_dir, micro_batch_rows=2)
        rows = _rows_with_system(trainer)  # scoring them calls attention too: count only the step and SFT
        grouped.clear()
        got = capture_grads(trainer)
        trainer.step(rows)
        grads.append(got[0])
        sft.append(trainer.completion_ce_backward([(r.prompt_ids, r.completion_ids) for r in rows[:3]], 0.1))
        # transformers groups heads itself only without a mask; the switch makes every training call group
        assert grouped and all(grouped) == (user_value is None)
        assert os.environ.get(FORCE_GQA) == user_value  # the switch is the block's only
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    assert sft[0] == pytest.approx(sft[1], rel=1e-5)


def test_grouped_key_value_heads_only_on_cpu(monkeypatch):
    from envace_core.training.attention import FORCE_GQA, grouped_kv_attention

    monkeypatch.delenv(FORCE_GQA, raising=False)
    with grouped_kv_attention(torch.device("cpu")) as on:
        assert on and os.environ[FORCE_GQA] == "1"
    with grouped_kv_attention(torch.device("cuda", 0)) as on:  # CUDA's kernels need no mask for groups
        assert not on and FORCE_GQA not in os.environ
    assert FORCE_GQA not in os.environ
