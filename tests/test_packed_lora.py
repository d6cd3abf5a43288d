"""packed_linear for peft LoRA layers at inference: one product on the packed merged weight W + s·BA, rebuilt
after the adapter changes, and peft's own forward wherever that merge would not be its forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from envace_core.engines import packed_linear
from envace_core.engines.base import SamplingParams
from envace_core.engines.hf import HFEngine

pytestmark = [pytest.mark.skipif(not packed_linear.available(torch.bfloat16, "cpu"),
                                 reason="this torch build or CPU has no oneDNN bf16 inner product"),
              pytest.mark.usefixtures("one_torch_thread")]




def _policy(dropout: float = 0.0, adapters=("default",)):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    base = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=dropout,
                      init_lora_weights=False)  # B != 0: the adapter changes the output
    model = get_peft_model(base, lcfg, adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, lcfg)
    return model.eval()


def _lora_layers(model):
    return [m for m in model.modules() if type(m).__module__.startswith("peft.tuners.lora") and hasattr(m, "lora_A")]


IDS = torch.tensor([[5, 17, 33, 2, 41, 9, 60, 11]])


def _bf16():
    """As HFEngine runs its forwards: packed products in bf16 under bf16 autocast (SDPA gets one dtype)."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _reference(model):
    """The peft forward, bf16 autocast, no packing: the logits packed-merged decoding should approximate."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=IDS).logits.float()


def test_lora_layers_run_on_their_merged_packed_weight():
    model = _policy()
    layers = _lora_layers(model)
    assert len(layers) == 4  # q and v of 2 layers
    cache = packed_linear.PackedLinears()
    with torch.inference_mode(), _bf16(), cache.installed(model):
        assert all("forward" in m.__dict__ for m in layers)
        got = model(input_ids=IDS).logits.float()
    assert not any("forward" in m.__dict__ for m in layers)
    assert cache.stats["merged"] == 4
    want = _reference(model)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    with torch.no_grad(), model.disable_adapter():
        base_only = model(input_ids=IDS).logits.float()
    assert (got - base_only).abs().max() > 0.05  # the adapter is in the packed product, not dropped


def test_merged_copy_follows_adapter_updates_and_is_reused_otherwise():
    model = _policy()
    cache = packed_linear.PackedLinears()
    with torch.inference_mode(), _bf16(), cache.installed(model):
        first = model(input_ids=IDS).logits.float()
    with torch.inference_mode(), _bf16(), cache.installed(model):
        assert torch.equal(model(input_ids=IDS).logits.float(), first)
    assert cache.stats["merged"] == 4
    with torch.no_grad():  # an optimizer step: in place on B
        for m in _lora_layers(model):
            m.lora_B["default"].weight.mul_(-3.0)
    with torch.inference_mode(), _bf16(), cache.installed(model):
        after = model(input_ids=IDS).logits.float()
    assert cache.stats["merged"] == 8
    torch.testing.assert_close(after, _reference(model), atol=0.05, rtol=0.05)
    assert not torch.allclose(after, first, atol=0.05)


@pytest.mark.parametrize("case", ["disabled", "merged", "dropout-training", "hooked", "frozen-only"])
def test_peft_forward_kept_where_the_merge_is_not_its_forward(case):
    model = _policy(dropout=0.5 if case == "dropout-training" else 0.0)
    layers = _lora_layers(model)
    cache = packed_linear.PackedLinears()
    if case == "merged":
        model.merge_adapter()
    if case == "dropout-training":
        model.train()
    if case == "hooked":
        layers[0].register_forward_hook(lambda mod, args, out: out)
    ctx = model.disable_adapter() if case == "disabled" else torch.inference_mode()
    with ctx, torch.no_grad():
        with _bf16(), cache.installed(model, frozen_only=case == "frozen-only"):
            swapped = ["forward" in m.__dict__ for m in layers]
    if case == "hooked":
        assert swapped == [False, True, True, True] and cache.stats["merged"] == 3
    else:
        assert not any(swapped) and cache.stats["merged"] == 0


def test_only_the_active_adapter_is_merged_and_a_switch_remerges():
    model = _policy(adapters=("act", "rehearse"))
    for m in _lora_layers(model):
        with torch.no_grad():
            m.lora_B["rehearse"].weight.mul_(-2.0)
    cache = packed_linear.PackedLinears()
    out = {}
    for name in ("act", "rehearse", "act"):
        model.set_adapter(name)
        with torch.inference_mode(), _bf16(), cache.installed(model):
            out.setdefault(name, []).append(model(input_ids=IDS).logits.float())
        torch.testing.assert_close(out[name][-1], _reference(model), atol=0.05, rtol=0.05)
    assert torch.equal(out["act"][0], out["act"][1]) and not torch.allclose(out["act"][0], out["rehearse"][0])
    assert cache.stats["merged"] == 8  # each adapter merged once: switching back reuses act's copies


def test_engine_generates_with_the_merged_adapter(ids_tokenizer):
    model = _policy()
    prompts = [[5, 17, 33, 2, 41], [7, 3, 9]]
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    packed = HFEngine(model, ids_tokenizer, compute_dtype="bfloat16").generate(prompts, sp)
    assert packed_linear.cache_for(model).stats["merged"] == 4
    for p, [c] in zip(prompts, packed):  # the recorded log-probs are the float32 peft model's, up to bf16
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        want = logp[torch.arange(len(p) - 1, ids.shape[1] - 1), ids[0, len(p):]]
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=0.1, rtol=0)


def test_factor_writes_without_a_version_bump_are_seen():
    """A fused optimizer step or a ``.data`` write changes A or B without bumping their versions: the merged
    copy is checked against the factors' values, so the next install merges again."""
    model = _policy()
    cache = packed_linear.PackedLinears()
    with torch.inference_mode(), _bf16(), cache.installed(model):
        first = model(input_ids=IDS).logits.float()
    for m in _lora_layers(model):
        w = m.lora_B["default"].weight
        version = w._version
        w.data.mul_(-3.0)
        assert w._version == version  # no bump
    with torch.inference_mode(), _bf16(), cache.installed(model):
        after = model(input_ids=IDS).logits.float()
    assert cache.stats["merged"] == 8
    torch.testing.assert_close(after, _reference(model), atol=0.05, rtol=0.05)
    assert not torch.allclose(after, first, atol=0.05)


@pytest.mark.parametrize("where", ["base_layer", "lora_A", "lora_B"])
def test_hooks_inside_a_lora_layer_keep_its_peft_forward(where):
    model = _policy()
    layer = _lora_layers(model)[0]
    sub = layer.base_layer if where == "base_layer" else getattr(layer, where)["default"]
    sub.register_forward_hook(lambda mod, args, out: out * 0.0)
    cache = packed_linear.PackedLinears()
    with torch.inference_mode(), _bf16(), cache.installed(model):
        assert "forward" not in layer.__dict__ and cache.stats["merged"] == 3
        got = model(input_ids=IDS).logits.float()
    torch.testing.assert_close(got, _reference(model), atol=0.05, rtol=0.05)  # the hook ran


def test_unused_copies_are_not_made_and_deleted_adapters_are_dropped():
    model = _policy(adapters=("act", "rehearse"))
    layers = _lora_layers(model)
    cache = packed_linear.PackedLinears()
    for name in ("act", "rehearse"):
        model.set_adapter(name)
        with torch.inference_mode(), _bf16(), cache.installed(model):
            model(input_ids=IDS)
    n_plain = sum(type(m) is torch.nn.Linear for m in model.modules()) \
        - sum(1 + len(m.lora_A) + len(m.lora_B) for m in layers)  # neither bases nor factors of merged layers
    assert cache.stats["merged"] == 8 and cache.stats["packed"] == 8 + n_plain
    with torch.inference_mode(), _bf16(), cache.installed(model):
        model(input_ids=IDS)
    assert cache.stats["packed"] == 8 + n_plain  # nothing re-packed on a repeat call
    before = cache.stats["bytes"]
    model.set_adapter("act")
    model.delete_adapter("rehearse")
    with torch.inference_mode(), _bf16(), cache.installed(model):
        model(input_ids=IDS)
    assert cache.stats["bytes"] < before and not any(isinstance(k, tuple) and k[1] == "rehearse"
                                                      for k in cache._entries)
