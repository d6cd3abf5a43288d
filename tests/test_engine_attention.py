"""The engine's CPU attention (`cpu_attention.engine_sdpa`): prefill with grouped KV heads equals transformers' SDPA
bit for bit, decode attends in float32, and whatever it does not handle goes to transformers unchanged."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from envace_core.engines import cpu_attention
from envace_core.engines.base import SamplingParams
from envace_core.engines.hf import HFEngine
from envace_core.models import load_model, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qkv(batch, heads, kv_heads, q_len, kv_len, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, 16, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, 16, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, 16, generator=g).to(dtype)
    return q, k, v


def _module(groups):
    return types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)


def _reused_prefix_mask(batch, q_len, kv_len, pad_first_row):
    """Bool (B, 1, Q, K): each query sees the reused prefix and its own earlier tokens; row 0 left-padded."""
    m = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)[None, None].repeat(batch, 1, 1, 1)
    m[0, :, :, :pad_first_row] = False
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_prefill_equals_transformers_bit_for_bit(dtype):
    q, k, v = _qkv(3, 6, 2, 9, 40, dtype)
    mask = _reused_prefix_mask(3, 9, 40, pad_first_row=5)
    ref, _ = sdpa_attention_forward(_module(3), q, k, v, mask, scaling=0.25)
    out, weights = cpu_attention.engine_sdpa(_module(3), q, k, v, mask, scaling=0.25)
    assert weights is None and out.dtype == dtype and out.shape == (3, 9, 6, 16)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_causal_prefill_without_mask_equals_transformers(dtype):
    q, k, v = _qkv(1, 4, 2, 12, 12, dtype, seed=1)
    ref, _ = sdpa_attention_forward(_module(2), q, k, v, None, scaling=0.25)
    out, _ = cpu_attention.engine_sdpa(_module(2), q, k, v, None, scaling=0.25)
    assert torch.equal(out, ref)
    noncausal = types.SimpleNamespace(num_key_value_groups=2, is_causal=False, training=False)
    assert not torch.equal(cpu_attention.engine_sdpa(noncausal, q, k, v, None, scaling=0.25)[0], ref)


def test_cases_it_does_not_handle_go_to_transformers(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward", spy)
    q, k, v = _qkv(1, 4, 2, 5, 9, torch.float32)
    mask = _reused_prefix_mask(1, 5, 9, pad_first_row=0)
    cpu_attention.engine_sdpa(_module(2), q, k, v, mask, scaling=0.25)  # handled here
    assert calls == []
    cpu_attention.engine_sdpa(_module(1), *_qkv(1, 4, 4, 5, 9, torch.float32), mask, scaling=0.25)  # no grouped heads
    cpu_attention.engine_sdpa(_module(2), q, k, v, mask, dropout=0.1, scaling=0.25)  # dropout
    cpu_attention.engine_sdpa(_module(2), q, k, v, None, scaling=0.25)  # no mask but a reused prefix: causal is ambiguous
    cpu_attention.engine_sdpa(_module(2), q[:, :, :1], k, v, mask[:, :, :1], scaling=0.25)  # decode: float32, transformers'
    assert len(calls) == 4


def test_decode_attends_in_float32():
    q, k, v = _qkv(2, 4, 2, 1, 30, torch.bfloat16, seed=2)
    out, _ = cpu_attention.engine_sdpa(_module(2), q, k, v, None, scaling=0.25)
    ref, _ = sdpa_attention_forward(_module(2), q.float(), k.float(), v.float(), None, scaling=0.25)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16))


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_generation_with_reused_prefixes_is_unchanged(tiny_model_dir, compute_dtype):
    """The tiny Llama has 4 query heads over 2 KV heads: the engine's attention against plain SDPA, same
    tokens and log-probs, with prompts that reuse a cached prefix (the prefill that the grouped path serves)."""
    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    assert model.config.num_attention_heads != model.config.num_key_value_heads
    base = tok.apply_chat_template([{"role": "user", "content": "Book the 9:40 flight to Rome, economy."}],
                                   add_generation_prompt=True, return_dict=False)
    prompts = [base, base + tok.encode(" and a hotel near the station", add_special_tokens=False),
               base + tok.encode(" please", add_special_tokens=False)]
    sp = SamplingParams(max_new_tokens=6, n=2, seed=3)

    def run(swap: bool):
        eng = HFEngine(model, tok, compute_dtype=compute_dtype, prefix_cache_tokens=10_000)
        if not swap:
            eng._swap_attention = lambda device: None
        first = eng.generate([prompts[0]], sp)
        return first, eng.generate(prompts[1:], sp), eng.stats["cached_tokens"]

    (a0, a1, cached), (b0, b1, _) = run(True), run(False)
    assert cached > 0  # the second call reused the first prompt's KV
    for x, y in zip(a0 + a1, b0 + b1):
        assert [c.token_ids for c in x] == [c.token_ids for c in y]
        assert [c.logprobs for c in x] == [c.logprobs for c in y]
