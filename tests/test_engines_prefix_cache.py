"""HFEngine's prefix cache: multi-turn rollouts that extend KV caches give the tokens and log-probs of
re-encoding the whole history (greedy, float32, tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from envace_core.engines.base import SamplingParams
from envace_core.engines.hf import HFEngine
from envace_core.engines.prefix_cache import PrefixPool
from envace_core.models import load_model, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def _chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_dict=False)


def _multi_turn(engine, tok, prompts, turns, n_first=1, max_new=8):
    """Each turn: prompt_{t+1} = prompt_t + completion_t + an inserted tool response (different lengths per
    trajectory, so batches mix cached lengths). Returns every turn's completions."""
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    seqs, out = list(prompts), []
    for t in range(turns):
        comps = [c[0] for c in engine.generate(seqs, sp)]
        out.append(comps)
        seqs = [s + c.token_ids + tok.encode(f" tool says {t} " + "x" * (3 * i + t), add_special_tokens=False)
                for i, (s, c) in enumerate(zip(seqs, comps))]
    return out


def _assert_same(a, b, atol=1e-4):
    for ta, tb in zip(a, b):
        for ca, cb in zip(ta, tb):
            assert ca.token_ids == cb.token_ids
            assert ca.finish_reason == cb.finish_reason
            assert torch.allclose(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=atol)


def test_incremental_turns_match_reencoding(model, tok):
    prompts = [_chat(tok, "Book a flight to Rome."), _chat(tok, "hi"),
               _chat(tok, "What is the weather in Berlin, in Celsius, right now please?")]
    plain = HFEngine(model, tok, compute_dtype="float32", max_batch_size=4)
    cached = HFEngine(model, tok, compute_dtype="float32", max_batch_size=4, prefix_cache_tokens=4096)
    ref = _multi_turn(plain, tok, prompts, turns=4)
    got = _multi_turn(cached, tok, prompts, turns=4)
    _assert_same(ref, got)
    # Turns 2-4 reused each trajectory's history: only the inserted text was prefilled.
    assert cached.stats["cached_tokens"] > 0
    assert cached.stats["prompt_tokens"] < plain.stats["prompt_tokens"] / 2
    assert cached.stats["prompt_tokens"] + cached.stats["cached_tokens"] == plain.stats["prompt_tokens"]


def test_group_then_per_trajectory_turns(model, tok):
    """A group's first turn (one prompt, n samples) seeds the cache its trajectories' later turns reuse."""
    prompt = _chat(tok, "Cancel my reservation ABC123 and refund me.")
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=7)
    results = []
    for kw in ({}, {"prefix_cache_tokens": 2048}):
        eng = HFEngine(model, tok, compute_dtype="float32", max_batch_size=8, **kw)
        first = eng.generate([prompt], sp)[0]
        nxt = [prompt + c.token_ids + tok.encode(" ok", add_special_tokens=False) for c in first]
        second = eng.generate(nxt, SamplingParams(max_new_tokens=6, temperature=0.0))
        results.append(([first], [[c[0] for c in second]], eng.stats))
    _assert_same(results[0][0], results[1][0])
    _assert_same(results[0][1], results[1][1])
    assert results[1][2]["cached_tokens"] >= 3 * len(prompt)


def test_weight_update_empties_the_cache(tiny_model_dir, tok):
    model = load_model(tiny_model_dir)
    prompt = _chat(tok, "Find order 42.")
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    eng = HFEngine(model, tok, compute_dtype="float32", prefix_cache_tokens=2048)
    eng.generate([prompt], sp)
    assert len(eng.prefix_pool) == 1
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=torch.tensor([prompt])).logits.sum().backward()
    opt.step()  # in-place update: stale KV must not be reused
    got = eng.generate([prompt], sp)[0][0]
    want = HFEngine(model, tok, compute_dtype="float32").generate([prompt], sp)[0][0]
    assert got.token_ids == want.token_ids
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    assert eng.stats["cached_tokens"] == 0


def test_bf16_incremental_close(model, tok):
    prompts = [_chat(tok, "Book a flight to Rome."), _chat(tok, "Two tickets to Oslo, window seats.")]
    ref = _multi_turn(HFEngine(model, tok, compute_dtype="bfloat16"), tok, prompts, turns=3)
    got = _multi_turn(HFEngine(model, tok, compute_dtype="bfloat16", prefix_cache_tokens=4096), tok, prompts,
                      turns=3)
    for ta, tb in zip(ref, got):  # bf16 rounding differs with batch shape: compare the first token's log-prob
        for ca, cb in zip(ta, tb):
            assert abs(ca.logprobs[0] - cb.logprobs[0]) < 0.1


def test_pool_lru_budget_and_prefix_dominance():
    kv = lambda n: [(torch.zeros(1, n, 2), torch.zeros(1, n, 2))]
    pool = PrefixPool(max_tokens=10)
    pool.add([1, 2, 3], kv(3))
    pool.add([1, 2, 3, 4, 5], kv(5))  # extends the first: replaces it
    assert len(pool) == 1 and pool.cached_tokens == 5
    pool.add([9, 9, 9, 9], kv(4))
    pool.add([7, 7], kv(2))  # 11 tokens > 10: the least recently used entry goes
    assert pool.cached_tokens == 6 and pool.lookup([1, 2, 3, 4, 5, 6]) == (0, None)
    m, e = pool.lookup([9, 9, 8])
    assert m == 2 and e.tokens.tolist() == [9, 9, 9, 9]
    assert pool.lookup([9, 9, 9, 9])[0] == 3  # capped: one prompt token is always fed
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixPool(0)


def test_negative_budget_rejected(model, tok):
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        HFEngine(model, tok, prefix_cache_tokens=-1)


def test_one_reused_prefix_is_held_not_copied_and_stays_intact(model, tok):
    """One prompt over a pool entry: the prefill's cache starts from views of the entry (no padding to do),
    the forward concatenates onto them, and the entry's tensors are unchanged for the next turn."""
    from envace_core.engines import hf
    from envace_core.engines.prefix_cache import padded_past

    eng = HFEngine(model, tok, compute_dtype="float32", prefix_cache_tokens=4096)
    p = _chat(tok, "Book a flight to Rome.")
    [[first]] = eng.generate([p], SamplingParams(max_new_tokens=4, temperature=0.0))
    m, entry = eng.prefix_pool.lookup(p + first.token_ids + [5, 6, 7])
    assert m > 0
    before = [(k.clone(), v.clone()) for k, v in entry.kv]
    past, mask = padded_past([(m, entry)])
    assert mask.tolist() == [[1] * m]
    assert past[0][0].untyped_storage().data_ptr() == entry.kv[0][0].untyped_storage().data_ptr()
    cache = hf._cache_holding(past, model.config)
    assert cache.get_seq_length() == m and cache.layers[0].keys is past[0][0]
    plain = HFEngine(model, tok, compute_dtype="float32")
    nxt = p + first.token_ids + tok.encode(" and back on Sunday", add_special_tokens=False)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    _assert_same(eng.generate([nxt], sp), plain.generate([nxt], sp))
    assert eng.stats["cached_tokens"] > 0
    for (k0, v0), (k1, v1) in zip(before, entry.kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_bf16_pool_keeps_what_later_turns_read(model, tok, monkeypatch):
    """With packed bf16 weights the pool holds KV in bf16 (half the memory): every later turn reads the reused
    tokens in bf16 anyway, so the turns are the same, bit for bit, as with a float32 pool that keeps each row's
    own tokens unrounded."""
    from envace_core.engines import packed_linear, shared_prefix

    if not packed_linear.available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no packed bf16 weights on this CPU")
    prompts = [_chat(tok, "Book a flight to Rome."), _chat(tok, "What is the weather in Berlin, in Celsius?")]

    def run():
        eng = HFEngine(model, tok, compute_dtype="bfloat16", max_batch_size=4, prefix_cache_tokens=8192)
        out = _multi_turn(eng, tok, prompts, turns=3)
        dtypes = {k.dtype for e in eng.prefix_pool._entries.values() for k, _ in e.kv}
        return out, dtypes, eng.stats["cached_tokens"]

    got, dtypes, cached = run()
    assert dtypes == {torch.bfloat16} and cached > 0

    def float32_row_kv(self, row):  # the pool as it was: the prompt part as read, own tokens unrounded
        p = int(self.owner[row])
        keep = self.prefix_mask[p]
        parts_k = [self.prefix_keys[p][:, keep], self.own_keys[row]]
        parts_v = [self.prefix_values[p][:, keep], self.own_values[row]]
        if self.root_keys is not None:
            parts_k.insert(0, self.root_keys[0])
            parts_v.insert(0, self.root_values[0])
        return torch.cat([t.float() for t in parts_k], 1), torch.cat([t.float() for t in parts_v], 1)

    monkeypatch.setattr(shared_prefix.SharedPrefixLayer, "row_kv", float32_row_kv)
    ref, ref_dtypes, _ = run()
    assert ref_dtypes == {torch.float32}
    for ta, tb in zip(got, ref):
        for ca, cb in zip(ta, tb):
            assert ca.token_ids == cb.token_ids and ca.logprobs == cb.logprobs
