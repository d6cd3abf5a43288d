"""Decode attention over bf16 prompts through torch's fused CPU attention kernel (`shared_prefix.attend`'s fused
route): the same attention as the classic path up to bf16 rounding, taken only where it applies, and the classic
path unchanged everywhere else."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from envace_core.engines import packed_linear, shared_prefix
from envace_core.engines.base import SamplingParams
from envace_core.engines.hf import HFEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H_KV, G, D, T = 2, 3, 16, 5


def _layer(pads: list[int], width: int, owner: list[int], dtype=torch.bfloat16, root: int = 0, seed: int = 0):
    """A decoding layer over len(pads) left-padded prompts of `width` columns (pads[p] padding columns) whose
    rows (`owner`) have each generated T tokens; with `root`, the prompts' first `root` tokens are the same."""
    g = torch.Generator().manual_seed(seed)
    p = len(pads)
    keys = torch.randn(p, H_KV, width, D, generator=g)
    values = torch.randn(p, H_KV, width, D, generator=g)
    mask = torch.ones(p, width, dtype=torch.bool)
    for i, n in enumerate(pads):
        mask[i, :n] = False
    if root:  # the same root tokens right after each row's padding
        for i, n in enumerate(pads):
            keys[i, :, n:n + root], values[i, :, n:n + root] = keys[0, :, pads[0]:pads[0] + root], \
                values[0, :, pads[0]:pads[0] + root]
    split = shared_prefix.root_split(mask, root) if root else None
    layer = shared_prefix.SharedPrefixLayer(keys, values, mask, torch.tensor(owner), 2, dtype, split)
    s = len(owner)
    layer.update(torch.randn(s, H_KV, T, D, generator=g), torch.randn(s, H_KV, T, D, generator=g))
    query = torch.randn(s, H_KV * G, 1, D, generator=g)
    return layer, query


def _reference(layer, query, scale):
    """Each row's attention over its whole sequence (root, unpadded prompt, own tokens), in float64, from the
    values the layer holds (prompts as stored, own tokens in float32)."""
    s = query.shape[0]
    out = []
    for row in range(s):
        k, v = layer.row_kv(row)  # own tokens rounded to the prompts' dtype: take them from the buffer instead
        t = layer.length
        k = torch.cat([k[:, :-t].double(), layer.own_keys[row].double()], 1)
        v = torch.cat([v[:, :-t].double(), layer.own_values[row].double()], 1)
        q = query[row, :, 0].double().view(H_KV, G, D)
        probs = torch.softmax(q @ k.transpose(-1, -2) * scale, -1)
        out.append((probs @ v).reshape(H_KV * G, D))
    return torch.stack(out)[:, None]  # (S, 1, H, D)


def _classic(layer, query, scale, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(shared_prefix, "FUSED_ATTENTION", False)
        return shared_prefix.attend(layer, query, layer.own_keys, layer.own_values, scale)


@pytest.mark.parametrize("case", [
    {"pads": [3], "width": 40, "owner": [0, 0, 0]},  # a GRPO group: one prompt, three rows
    {"pads": [0], "width": 40, "owner": [0]},  # one prompt, one row
    {"pads": [0, 7, 2], "width": 40, "owner": [0, 1, 2]},  # distinct prompts, one row each, padded
    {"pads": [0, 7, 2], "width": 40, "owner": [0, 1, 2], "root": 12},  # and a common root
    {"pads": [5, 0], "width": 40, "owner": [0, 0, 1, 1]},  # two prompts, two samples each
    {"pads": [0, 7], "width": 40, "owner": [0, 0, 1, 1], "root": 12},  # and a common root
])
def test_fused_route_is_the_attention_up_to_bf16_rounding(case, monkeypatch):
    if not shared_prefix.fused_kernel_available():
        pytest.skip("this torch has no fused CPU attention op")
    layer, query = _layer(**case)
    assert layer.fused_route()[0]
    if case.get("root"):
        assert layer.root_keys is not None and layer.root_keys.shape[2] == case["root"]
    scale = 0.5  # not the kernel's default 1/sqrt(D): the scale must be passed
    seen = []
    monkeypatch.setattr(shared_prefix, "_attend_fused",
                        lambda *a, _f=shared_prefix._attend_fused: (seen.append(1), _f(*a))[1])
    fused = shared_prefix.attend(layer, query, layer.own_keys, layer.own_values, scale)
    assert seen and fused.shape == (query.shape[0], 1, H_KV * G, D) and fused.dtype == query.dtype
    classic = _classic(layer, query, scale, monkeypatch)
    ref = _reference(layer, query, scale)
    err_fused = (fused.double() - ref).abs().max().item()
    err_classic = (classic.double() - ref).abs().max().item()
    # both read the prompts' bf16 keys and values and round the prompt part's output to bf16
    assert err_fused < 5e-2 and err_classic < 5e-2
    assert err_fused <= 2 * err_classic + 1e-3


@pytest.mark.parametrize("why", ["float32", "shared_rows", "rows_of_two_of_four", "rows_swapped", "rows_interleaved",
                                 "all_root_row", "switched_off", "selected_rows"])
def test_classic_path_where_the_fused_route_does_not_apply(why, monkeypatch):
    kwargs = {"pads": [0, 4, 1], "width": 30, "owner": [0, 1, 2]}
    if why == "float32":
        kwargs["dtype"] = torch.float32
    elif why == "shared_rows":  # several prompts, several rows each: no one call reads each prompt once
        kwargs["owner"] = [0, 0, 1, 2]
    elif why == "rows_of_two_of_four":  # S divisible by P, but the rows read two of the four prompts
        kwargs.update(pads=[0, 3, 1, 2], owner=[0, 0, 1, 1])
    elif why == "rows_swapped":
        kwargs.update(pads=[0, 3, 1, 2], owner=[1, 0, 2, 3])
    elif why == "rows_interleaved":
        kwargs.update(pads=[0, 3, 1, 2], owner=[0, 1, 0, 1, 2, 3, 2, 3])
    elif why == "all_root_row":  # prompt 2 is its root only: its prompt part after the root is all padding
        kwargs.update(pads=[0, 4, 18], root=12)
    layer, query = _layer(**kwargs)
    if why == "switched_off":  # also after the layer decided its route
        assert layer.fused_route()[0] or not shared_prefix.fused_kernel_available()
        monkeypatch.setattr(shared_prefix, "FUSED_ATTENTION", False)
    if why == "selected_rows":  # the batch lost a row: rows are no longer prompt i's only row
        assert layer.fused_route()[0] or not shared_prefix.fused_kernel_available()
        layer.batch_select_indices(torch.tensor([0, 2]))
        query = query[[0, 2]]
    assert not layer.fused_route()[0]
    monkeypatch.setattr(shared_prefix, "_attend_fused", lambda *a: pytest.fail("fused route taken"))
    out = shared_prefix.attend(layer, query, layer.own_keys, layer.own_values, 0.25)
    torch.testing.assert_close(out.double(), _reference(layer, query, 0.25), atol=2e-2, rtol=0)


def test_no_own_tokens_yet_takes_the_classic_path(monkeypatch):
    """The kernel aborts the process on zero-length keys: a layer before its first update never calls it."""
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, H_KV, 12, D, generator=g), torch.randn(2, H_KV, 12, D, generator=g)
    layer = shared_prefix.SharedPrefixLayer(keys, values, torch.ones(2, 12, dtype=torch.bool), torch.tensor([0, 1]),
                                            2, torch.bfloat16)
    query = torch.randn(2, H_KV * G, 1, D, generator=g)
    monkeypatch.setattr(shared_prefix, "_attend_fused", lambda *a: pytest.fail("fused route taken"))
    out = shared_prefix.attend(layer, query, layer.own_keys, layer.own_values, 0.5)
    assert out.shape == (2, 1, H_KV * G, D) and bool(torch.isfinite(out).all())


def test_engine_decodes_alike_with_and_without_the_fused_route(ids_tokenizer, monkeypatch):
    if not shared_prefix.fused_kernel_available():
        pytest.skip("this torch has no fused CPU attention op")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 101, (n,), generator=g).tolist() for n in (30, 9, 21)]
    seen = []
    orig = shared_prefix._attend_fused
    monkeypatch.setattr(shared_prefix, "_attend_fused", lambda *a: (seen.append(1), orig(*a))[1])
    params = [SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=6, n=3, seed=4, ignore_eos=True)]
    if not packed_linear.available(torch.bfloat16, "cpu"):
        pytest.skip("no packed bf16 weights on this CPU: the engine keeps prompts in float32")
    eng = HFEngine(model, ids_tokenizer, compute_dtype="bfloat16")
    fused = [eng.generate(prompts, p) for p in params]
    assert seen
    monkeypatch.setattr(shared_prefix, "FUSED_ATTENTION", False)
    seen.clear()
    classic = [HFEngine(model, ids_tokenizer, compute_dtype="bfloat16").generate(prompts, p) for p in params]
    assert not seen
    compared = 0
    for outs in zip(fused, classic):
        for rows in zip(*outs):
            for f, c in zip(*rows):
                for k, (a, b) in enumerate(zip(f.token_ids, c.token_ids)):
                    # the same token with the same log-prob up to bf16 rounding; a random tiny model's next-token
                    # distribution is near-uniform, so two tokens may tie to the third decimal: there the
                    # paths may pick either (both log-probs equal), and the rows differ from then on
                    assert abs(f.logprobs[k] - c.logprobs[k]) < 2e-2
                    if a != b:
                        assert abs(f.logprobs[k] - c.logprobs[k]) < 5e-3
                        break
                    compared += 1
    assert compared >= 40  # of 72 generated tokens


@pytest.mark.parametrize("pads", [[0, 0, 0], [0, 7, 2]])
def test_one_row_per_prompt_as_grouped_heads_equals_the_query_position_layout(pads, monkeypatch):
    """One row per prompt goes to the kernel as H_kv * g query heads over H_kv key/value heads; the same output
    and log-sum-exp as the g-queries-per-KV-head layout that several rows per prompt take."""
    if not shared_prefix.grouped_kernel_available():
        pytest.skip("this torch's fused CPU attention op takes no grouped key/value heads")
    layer, query = _layer(pads, 40, list(range(len(pads))))
    _, mask = layer.fused_route()
    q = query.float().view(len(pads), H_KV, G, D)
    grouped = shared_prefix._fused_part(q, layer.prefix_keys, layer.prefix_values, 0.5, mask)
    monkeypatch.setattr(shared_prefix, "GQA_ONE_ROW", False)
    positions = shared_prefix._fused_part(q, layer.prefix_keys, layer.prefix_values, 0.5, mask)
    for a, b in zip(grouped, positions):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=0)


def test_grouped_kernel_probe_is_cached_and_needs_the_fused_op(monkeypatch):
    monkeypatch.setattr(shared_prefix, "_GQA_PROBE", [])
    monkeypatch.setattr(shared_prefix, "_FUSED_PROBE", [False])
    assert shared_prefix.grouped_kernel_available() is False
    assert shared_prefix._GQA_PROBE == [False]
