"""PolicyTrainer on the tiny random Llama: exact ids, gradient accumulation, frozen roles, adapters."""

from __future__ import annotations

import pytest
import torch

from envace_core.config import TrainConfig
from envace_core.models import load_model, load_tokenizer
from envace_core.trainer import AdapterLoadError, PolicyTrainer, TrainingRow
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


def test_frozen_role_rows_and_empty_completions_are_ignored(tiny_model_dir):
    act = make_rows(3, seed=1)
    user = make_rows(3, seed=2, role="user")
    for r in user:
        r.advantage = 10.0
    empty = TrainingRow("act", [1, 2, 3], [], [], 5.0)
    grads = []
    for rows in (act, act + user + [empty]):
        trainer = make_trainer(tiny_model_dir, trained_roles=["act"])
        captured = capture_grads(trainer)
        m = trainer.step(rows)
        grads.append(captured[0])
    assert m["rows"] == 3 and m["rows_skipped"] == 4
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no trainable row"):
        trainer.step(user + [empty])


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
