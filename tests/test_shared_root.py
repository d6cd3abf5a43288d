"""Distinct prompts with a common root decode with the root's KV read once (shared_prefix.root_split and
SharedPrefixCache(root=...)), giving what decoding each prompt's whole KV gives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from envace_core.engines import hf as hf_engine
from envace_core.engines import shared_prefix
from envace_core.engines.base import SamplingParams
from envace_core.engines.hf import HFEngine
from envace_core.engines.prefix_cache import common_prefix

pytestmark = pytest.mark.usefixtures("one_torch_thread")




@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _prompts(root_len: int, tails: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    root = torch.randint(1, 101, (root_len,), generator=g).tolist()
    return [root + torch.randint(1, 101, (n,), generator=g).tolist() for n in tails]


def test_root_split_positions():
    # rows: [pad pad r r r a b], [r r r c d e f], [pad pad pad pad r r r]  (root = 3)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    split = shared_prefix.root_split(mask, 3)
    assert (split.row, split.lo, split.hi, split.start) == (0, 2, 5, 3)
    assert split.suffix_mask.tolist() == [[False, False, True, True],  # columns 3..6: row 0's root ends at 4
                                          [True, True, True, True],
                                          [False, False, False, False]]  # row 2 is all root
    # padding inside a row's root (a prefix-pool entry padded to the longest reused prefix): another row
    # holds the root whole, and the padded row's root columns are masked out of its suffix
    mask = torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    split = shared_prefix.root_split(mask, 3)
    assert (split.row, split.lo, split.hi, split.start) == (1, 0, 3, 3)
    assert split.suffix_mask.tolist() == [[False, True, True], [True, True, True]]
    assert shared_prefix.root_split(torch.tensor([[1, 0, 1, 1]], dtype=torch.bool), 2) is None  # none whole
    assert shared_prefix.root_split(mask, 0) is None
    with pytest.raises(ValueError, match="fewer than root"):
        shared_prefix.root_split(mask, 6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_distinct_prompts_with_a_root_decode_as_without(model, dtype, monkeypatch, ids_tokenizer):
    prompts = _prompts(80, [5, 17, 1, 9])  # 80 common tokens, then different tails (one of 1 token)
    assert common_prefix(prompts) == 80
    seen = []
    orig = shared_prefix.SharedPrefixLayer.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen.append(self.root_keys is not None and self.root_keys.shape[2] == 80)

    monkeypatch.setattr(shared_prefix.SharedPrefixLayer, "__init__", spy)
    sp = SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=7, n=2, seed=5, ignore_eos=True)
    with_root = [HFEngine(model, ids_tokenizer, compute_dtype=dtype).generate(prompts, p) for p in (sp, sampled)]
    assert seen and all(seen)
    seen.clear()
    monkeypatch.setattr(hf_engine, "_MIN_SHARED_ROOT", 10**9)
    without = [HFEngine(model, ids_tokenizer, compute_dtype=dtype).generate(prompts, p) for p in (sp, sampled)]
    assert seen and not any(seen)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for a_out, b_out in zip(with_root, without):
        for a_row, b_row in zip(a_out, b_out):
            for a, b in zip(a_row, b_row):
                assert a.token_ids == b.token_ids
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=tol, rtol=0)


def test_next_turn_from_the_prefix_pool_with_a_root(model, ids_tokenizer):
    """Second turns of trajectories that share a root: the pooled entries (root + tail + own tokens) are
    reused, padded to each other, and the root split still gives what re-encoding gives."""
    prompts = _prompts(70, [3, 11, 6], seed=2)
    eng = HFEngine(model, ids_tokenizer, compute_dtype="float32", prefix_cache_tokens=4096)
    first = eng.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    nxt = [p + row[0].token_ids + [7, 8, 9][:i + 1] for i, (p, row) in enumerate(zip(prompts, first))]
    before = eng.stats["cached_tokens"]
    again = eng.generate(nxt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    assert eng.stats["cached_tokens"] > before  # the pool served the shared history
    fresh = HFEngine(model, ids_tokenizer, compute_dtype="float32").generate(
        nxt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    for a, b in zip(again, fresh):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-4, rtol=0)


@pytest.mark.skipif(not hf_engine.packed_linear.available(torch.bfloat16, "cpu"),
                    reason="bf16 shared-prefix decode needs packed bf16 weights (AVX-512 BF16 / AMX)")
def test_prefill_kv_reaches_decode_in_its_dtype(model, monkeypatch, ids_tokenizer):
    """With bf16 packed weights the prompts' KV is read in bf16: the prefill hands it over in bf16 (each row
    cast as it is prefilled, a pool-hit prefill cast once), so no float32 copy of it lives through decode."""
    seen = []
    orig = shared_prefix.SharedPrefixLayer.__init__

    def spy(self, prefix_keys, prefix_values, *a, **k):
        seen.append((prefix_keys.dtype, prefix_values.dtype, a[3]))  # a[3]: the decode dtype
        orig(self, prefix_keys, prefix_values, *a, **k)

    monkeypatch.setattr(shared_prefix.SharedPrefixLayer, "__init__", spy)
    prompts = _prompts(70, [3, 11, 6], seed=3)
    eng = HFEngine(model, ids_tokenizer, compute_dtype="bfloat16", prefix_cache_tokens=4096)
    first = eng.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    nxt = [p + row[0].token_ids + [5, 6] for p, row in zip(prompts, first)]
    eng.generate(nxt, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))  # from the pool
    assert eng.stats["cached_tokens"] > 0
    assert seen and all(k == v == dt == torch.bfloat16 for k, v, dt in seen)
