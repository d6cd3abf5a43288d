"""Chunked log-probs from the LM head: same numbers and gradients as the full [B, T, V] logits, with
a bounded number of logit rows at a time (unit level, then through PolicyTrainer on the tiny Llama)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from envace_core.training.grpo import token_logprobs
from envace_core.training.logprobs import chunked_token_logprobs
from tests.test_trainer import capture_grads, make_rows, make_trainer, on_policy

B, T, D, V = 3, 11, 8, 1000


class LogitRows(TorchDispatchMode):
    """Records, for every op output whose last dim is the vocabulary, its number of rows (numel / V),
    forward and backward; views of the head weight itself (its transpose [d, V]) are left out."""

    def __init__(self, vocab: int, weight: torch.Tensor):
        super().__init__()
        self.vocab, self.ptr, self.rows = vocab, weight.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab \
                    and t.untyped_storage().data_ptr() != self.ptr:
                self.rows.append(t.numel() // self.vocab)
        return out


def _case(seed=0, trainable_head=False, bias=False):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(D, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    head.requires_grad_(trainable_head)
    hidden = torch.randn(B, T, D, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (a, n) in enumerate([(0, 11), (3, 5), (6, 2)]):  # ragged completions, padding after
        mask[i, a:a + n] = True
    temp = torch.tensor([1.0, 0.7, 1.3])
    upstream = torch.randn(B, T, generator=g)  # d loss / d logp
    return head, hidden, targets, mask, temp, upstream


def _reference(head, hidden, targets, mask, temp, upstream):
    """The full-logits path: grpo.token_logprobs over head(hidden), entropy of the masked rows."""
    logits = head(hidden).float()  # [B, T, V]
    lp = token_logprobs(logits, targets, temp)
    (torch.where(mask, lp, 0.0) * upstream).sum().backward()
    with torch.no_grad():
        logp = torch.log_softmax(logits[mask] / temp[:, None].expand(B, T)[mask][:, None], -1)
        ent = float(-(logp.exp() * logp).sum())
    return lp.detach(), ent


def _grads(head, hidden):
    out = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters() if p.grad is not None]
    hidden.grad = None
    for p in head.parameters():
        p.grad = None
    return out


@pytest.mark.parametrize("chunk", [1, 4, 7, 10_000])
@pytest.mark.parametrize("trainable_head,bias", [(False, False), (True, False), (True, True)])
def test_values_entropy_and_gradients_equal_the_full_logits(chunk, trainable_head, bias):
    head, hidden, targets, mask, temp, upstream = _case(trainable_head=trainable_head, bias=bias)
    want_lp, want_ent = _reference(head, hidden, targets, mask, temp, upstream)
    want_g = _grads(head, hidden)
    lp, ent = chunked_token_logprobs(hidden, head, targets, temp, mask, chunk, entropy=True)
    (torch.where(mask, lp, 0.0) * upstream).sum().backward()
    got_g = _grads(head, hidden)
    assert lp.shape == (B, T) and lp.dtype == torch.float32
    assert torch.allclose(lp[mask], want_lp[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(lp[~mask], torch.zeros_like(lp[~mask]))
    assert ent == pytest.approx(want_ent, rel=1e-5)
    assert len(got_g) == len(want_g) == 1 + trainable_head * (1 + bias)
    for a, b in zip(got_g, want_g):
        # Each gradient entry sums V = 1000 float32 terms; a chunk of one row runs other matmul kernels
        # than the full [B, T, V] product and sums in another order (seen: 6.7e-6 on entries up to 8.3
        # on an AVX-512 CPU, about 7 ulp), so the tolerance scales with the tensor's magnitude.
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_no_grad_call_and_float_temperature():
    head, hidden, targets, mask, _, _ = _case()
    with torch.no_grad():
        lp, ent = chunked_token_logprobs(hidden, head, targets, 0.7, mask, 3)
        want = token_logprobs(head(hidden), targets, 0.7)
    assert not lp.requires_grad and ent == 0.0
    assert torch.allclose(lp[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    head, hidden, targets, mask, temp, _ = _case()
    with pytest.raises(TypeError, match="nn.Linear"):
        chunked_token_logprobs(hidden, torch.nn.Sequential(head), targets, temp, mask)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(hidden, head, targets, temp, mask, 0)
    with pytest.raises(ValueError, match=r"\[B, T, d\]"):
        chunked_token_logprobs(hidden, head, targets[:, :-1], temp, mask)


@pytest.mark.parametrize("trainable_head", [False, True])
def test_no_tensor_holds_more_than_chunk_rows_of_logits(trainable_head):
    head, hidden, targets, mask, temp, upstream = _case(trainable_head=trainable_head)
    with LogitRows(V, head.weight) as mon:
        lp, _ = chunked_token_logprobs(hidden, head, targets, temp, mask, 4, entropy=True)
        (lp * upstream).sum().backward()
    assert mon.rows and max(mon.rows) <= 4
    with LogitRows(V, head.weight) as mon:  # the monitor does see the full path's [B, T, V]
        (token_logprobs(head(hidden), targets, temp) * upstream).sum().backward()
    assert max(mon.rows) == B * T


# --- through PolicyTrainer (tiny random Llama, LoRA on q/v, frozen tied head) --------------------


def _run(trainer, rows, chunk):
    trainer.logprob_chunk_tokens = chunk
    lps = trainer.completion_logprobs(rows)
    grads = capture_grads(trainer)
    m = trainer.step(rows)
    return lps, m, grads[0]


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_trainer_step_equals_the_full_logits_path(tiny_model_dir, shared, compute_dtype):
    results = []
    for chunk in (None, 5, 10_000):  # None: the full [B, T, V] path; 5: several chunks per micro-batch
        trainer = make_trainer(tiny_model_dir, compute_dtype=compute_dtype, micro_batch_rows=4, kl_beta=0.1)
        rows = on_policy(trainer, make_rows(7, shared=shared))
        for r in rows:  # off-policy a bit so ratios and clipping are not trivial
            r.old_logprobs = [x + 0.3 * ((i % 3) - 1) for i, x in enumerate(r.old_logprobs)]
        results.append(_run(trainer, rows, chunk))
    (lps0, m0, g0), *others = results
    assert m0["clip_frac"] > 0 and m0["kl_ref"] > 0 and m0["entropy"] > 0
    for lps, m, g in others:
        for a, b in zip(lps, lps0):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
        for k in ("loss", "entropy", "kl_ref", "approx_kl", "ratio_mean", "grad_norm"):
            assert m[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), k
        assert m["clip_frac"] == m0["clip_frac"]
        # float32: summation order only, 1e-5 of the tensor's scale. bfloat16: the head's float32
        # gradient is rounded to bf16 into the backbone, so 1e-7 differences flip roundings; the full
        # path's own micro-batch sizes 1, 2 and 4 already differ by ~7e-3 there.
        tol = 1e-5 if compute_dtype == "float32" else 1e-2
        for a, b in zip(g, g0):
            assert torch.linalg.norm(a - b) <= tol * torch.linalg.norm(b)
            if compute_dtype == "float32":
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_trainer_runs_the_head_on_at_most_chunk_rows(tiny_model_dir, monkeypatch):
    trainer = make_trainer(tiny_model_dir, micro_batch_rows=8)
    rows = make_rows(6)
    W = trainer._head.weight
    calls = []
    linear = torch.nn.functional.linear

    def spy(x, weight, bias=None):
        if weight is W:
            calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    trainer.logprob_chunk_tokens = 4
    with LogitRows(W.shape[0], W) as mon:
        trainer.step(rows)
    assert calls and max(calls) <= 4
    assert sum(calls) == sum(len(r.completion_ids) for r in rows)  # completion tokens only, once each
    assert max(mon.rows) <= 4
    calls.clear()
    trainer.logprob_chunk_tokens = None  # the full path runs the head on every span position at once
    trainer.step(rows)
    assert max(calls) > 4


def test_a_head_that_is_not_plain_linear_takes_the_full_path(tiny_model_dir, monkeypatch):
    import envace_core.training.trainer as trainer_mod

    trainer = make_trainer(tiny_model_dir)
    rows = make_rows(3)
    want = trainer.completion_logprobs(rows)
    monkeypatch.setattr(trainer_mod, "chunked_token_logprobs",
                        lambda *a, **k: pytest.fail("chunked path used without a plain linear head"))
    trainer._split_head = False  # what `_head_is_plain_linear` says of a soft-capped head
    for a, b in zip(trainer.completion_logprobs(rows), want):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
    assert trainer.step(rows)["entropy"] > 0
