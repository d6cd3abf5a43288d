"""engines.fused_decode: one decode step in one loop over the layers gives the transformers forward's logits."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from envace_core.engines import fused_decode, packed_linear, shared_prefix
from envace_core.engines.base import SamplingParams
from envace_core.engines.hf import HFEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZES = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": lambda: LlamaConfig(**SIZES, head_dim=8),
    "mistral": lambda: MistralConfig(**SIZES, head_dim=8, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SIZES, use_sliding_window=False),  # q/k/v biases
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=8, use_sliding_window=False),  # q/k norms
}




def _model(family: str, lora: bool = False, head_dim: int = 8):
    """A tiny random model of `family`; `head_dim` 64 makes the attention's products take the blocked
    paths real models take (at 8 they may round like a plain loop)."""
    torch.manual_seed(0)
    cfg = FAMILIES[family]()
    if head_dim != 8:
        cfg.head_dim = head_dim
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = 0
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))  # B != 0: the adapter counts
        model.eval()
    return model


PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [7, 3], [12, 88, 45, 21, 19]]


def _prefill(model, prompts):
    """Left-padded prefill of `prompts`: the DynamicCache, its (P, L) mask, the last logits, next positions."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    return out.past_key_values, mask, out.logits[:, -1].float(), mask.sum(-1)


@pytest.mark.parametrize("owner", [[0, 0, 1, 2, 2], [0, 1, 2]], ids=["grouped", "one-row-per-prompt"])
@pytest.mark.parametrize("family,lora,head_dim", [(f, False, 8) for f in FAMILIES]
                         + [("llama", True, 8), ("qwen3", True, 8), ("llama", False, 64), ("qwen3", False, 64)])
def test_step_equals_the_transformers_forward_exactly(family, lora, head_dim, owner):
    model = _model(family, lora, head_dim)
    assert fused_decode.supports(model)
    shared_prefix.register()
    prefill, mask, logits, nxt = _prefill(model, PROMPTS)
    owner = torch.tensor(owner)  # prompt row of each decode row
    s = owner.numel()
    ref_cache = shared_prefix.SharedPrefixCache(prefill, mask, owner, 2, torch.float32)
    got_cache = shared_prefix.SharedPrefixCache(prefill, mask, owner, 2, torch.float32)  # grows past 2
    tokens = logits.argmax(-1).index_select(0, owner)[:, None]
    pos = nxt.index_select(0, owner)[:, None]
    lm = model.get_base_model() if lora else model
    kw = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
    with torch.inference_mode():
        for _ in range(4):
            with shared_prefix.active(model, ref_cache):
                ref = model(input_ids=tokens, position_ids=pos, use_cache=True, **{kw: ref_cache}).logits[:, -1].float()
            got = fused_decode.step(model, tokens, pos, got_cache)
            assert got.shape == ref.shape == (s, 97) and got.dtype == torch.float32
            assert torch.equal(got, ref)
            tokens, pos = got.argmax(-1)[:, None], pos + 1
    assert all(torch.equal(a.own_keys, b.own_keys) for a, b in zip(got_cache.layers, ref_cache.layers))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_generates_the_same_with_and_without_the_fused_step(family, dtype, ids_tokenizer):
    if dtype == "bfloat16" and not packed_linear.available(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN bf16 on this CPU: the fused step runs only without per-call weight copies")
    model = _model(family, lora=True)
    out = {}
    for fused in (False, True):
        eng = HFEngine(model, ids_tokenizer, compute_dtype=dtype, max_batch_size=4, fused_decode=fused)
        out[fused] = [eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)),
                      eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, n=3, seed=3, ignore_eos=True))]
    for plain, fused in zip(out[False], out[True]):
        for a_row, b_row in zip(plain, fused):
            for a, b in zip(a_row, b_row):
                assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
                assert a.logprobs == b.logprobs  # the same ops on the same values: bit for bit


def test_hooks_and_foreign_layer_classes_keep_the_transformers_forward(ids_tokenizer):
    """`step` bypasses the decoder's modules' forward: a hook there (steering, probes) or a subclass with its
    own forward would be skipped, so such a model is refused and decodes through transformers."""
    model = _model("llama")
    assert fused_decode.supports(model)
    handle = model.model.layers[1].register_forward_hook(lambda mod, args, out: out)
    assert not fused_decode.supports(model)
    handle.remove()
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(lambda mod, args: None)
    assert not fused_decode.supports(model)
    handle.remove()
    assert fused_decode.supports(model)
    layer = model.model.layers[0]
    layer.__class__ = type("CustomLayer", (type(layer),), {"forward": lambda self, *a, **k: None})
    try:
        assert not fused_decode.supports(model)
    finally:
        layer.__class__ = type(layer).__mro__[1]
    # a steering hook changes the engine's output the same way with and without the fused step
    model.model.layers[0].register_forward_hook(lambda mod, args, out: out * 3.0)
    outs = [HFEngine(model, ids_tokenizer, compute_dtype="float32", fused_decode=f).generate(
        PROMPTS, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)) for f in (False, True)]
    assert [[c.token_ids for c in r] for r in outs[0]] == [[c.token_ids for c in r] for r in outs[1]]


def test_unsupported_models_and_bad_input():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=97, n_embd=48, n_layer=1, n_head=4))
    assert not fused_decode.supports(gpt2)
    windowed = AutoModelForCausalLM.from_config(MistralConfig(**SIZES, head_dim=8, sliding_window=4),
                                                attn_implementation="sdpa")
    assert not fused_decode.supports(windowed)  # a sliding window is not full attention
    model = _model("llama")
    prefill, mask, _, _ = _prefill(model, PROMPTS[:1])
    cache = shared_prefix.SharedPrefixCache(prefill, mask, torch.tensor([0]), 2, torch.float32)
    with pytest.raises(ValueError, match=r"\(S, 1\)"):
        fused_decode.step(model, torch.tensor([[1, 2]]), torch.tensor([[7, 8]]), cache)
    with pytest.raises(ValueError, match="S >= 1"):
        fused_decode.step(model, torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1), dtype=torch.long), cache)
    with pytest.raises(ValueError, match="position ids"):
        fused_decode.step(model, torch.tensor([[1]]), torch.tensor([[7, 8]]), cache)
    with pytest.raises(ValueError, match="no Llama-family decoder"):
        fused_decode.step(gpt2, torch.tensor([[1]]), torch.tensor([[7]]), cache)
    two = shared_prefix.SharedPrefixCache(prefill, mask, torch.tensor([0, 0]), 2, torch.float32)
    with pytest.raises(ValueError, match="2 decode rows, input ids 1"):
        fused_decode.step(model, torch.tensor([[1]]), torch.tensor([[7]]), two)
    assert all(layer.length == 0 for layer in two.layers)  # refused before the cache was touched
    cache.layers = cache.layers[:1]
    with pytest.raises(ValueError, match="1 layers, the model 2"):
        fused_decode.step(model, torch.tensor([[1]]), torch.tensor([[7]]), cache)


def test_lora_on_the_embedding_generates(ids_tokenizer):
    """peft's LoRA embedding has no ``num_embeddings``; the engine's token-id check reads the weight's rows."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model("llama"), LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"],
                                                       init_lora_weights=False)).eval()
    out = HFEngine(model, ids_tokenizer, compute_dtype="float32").generate(
        PROMPTS, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    assert [len(r[0].token_ids) for r in out] == [3, 3, 3]
    with pytest.raises(ValueError, match="token id"):
        HFEngine(model, ids_tokenizer, compute_dtype="float32").generate([[5, 97]],
                                                                         SamplingParams(max_new_tokens=1))
