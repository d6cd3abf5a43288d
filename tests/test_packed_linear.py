"""Packed bf16 linears (oneDNN) for HFEngine: same outputs as F.linear, forwards restored, re-packed when a
weight changes in place, and used by HFEngine for bf16 on CPU."""

from __future__ import annotations

import pytest
import torch

from envace_core.engines import packed_linear
from envace_core.engines.base import SamplingParams
from envace_core.engines.hf import HFEngine
from envace_core.models import load_model, load_tokenizer

needs_packing = pytest.mark.skipif(not packed_linear.available(torch.bfloat16, "cpu"),
                                   reason="this torch build or CPU has no oneDNN bf16 inner product")


def test_only_bf16_on_cpu():
    assert not packed_linear.available(torch.float32, "cpu")
    assert not packed_linear.available(torch.float16, "cpu")
    assert not packed_linear.available(torch.bfloat16, "cuda")


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8, bias=False))


@needs_packing
def test_same_outputs_as_bf16_linear_and_forwards_restored():
    net, x = _net(), torch.randn(2, 5, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = net(x)
    cache = packed_linear.PackedLinears()
    with torch.inference_mode(), cache.installed(net):
        assert all("forward" in m.__dict__ for m in net if isinstance(m, torch.nn.Linear))
        got = net(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 8)
    torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)
    assert not any("forward" in m.__dict__ for m in net)  # the class forward is back
    assert cache.stats["packed"] == 2 and cache.stats["bytes"] == (24 * 16 + 8 * 24) * 2


@needs_packing
def test_forwards_restored_on_error_and_an_existing_instance_forward_kept():
    net = _net()
    own = net[2].forward
    net[2].forward = own  # an instance attribute, as accelerate's hooks set
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), packed_linear.PackedLinears().installed(net):
        raise RuntimeError("boom")
    assert "forward" not in net[0].__dict__ and net[2].__dict__["forward"] is own


@needs_packing
def test_repacked_only_when_a_weight_changes_in_place():
    net, x = _net(), torch.randn(3, 16)
    cache = packed_linear.PackedLinears()
    with torch.inference_mode(), cache.installed(net):
        before = net(x)
    with torch.inference_mode(), cache.installed(net):
        again = net(x)
    assert cache.stats == {"packed": 2, "reused": 2, "bytes": cache.stats["bytes"], "merged": 0}
    assert torch.equal(before, again)
    with torch.no_grad():
        net[2].weight.mul_(-1.0)  # an optimizer step is an in-place update too
    with torch.inference_mode(), cache.installed(net):
        after = net(x)
    assert cache.stats["packed"] == 3 and cache.stats["reused"] == 3
    torch.testing.assert_close(after.float(), -before.float(), atol=1e-2, rtol=0)


@needs_packing
def test_float32_layers_are_left_alone():
    net = _net().to(torch.bfloat16)
    with torch.no_grad(), packed_linear.PackedLinears().installed(net) as cache:
        assert not any("forward" in m.__dict__ for m in net)
    assert cache.stats["packed"] == 0


@needs_packing
def test_hf_engine_uses_packed_weights_and_matches_teacher_forcing(tiny_model_dir):
    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Book a flight to Rome."}],
                                     add_generation_prompt=True, return_dict=False)
    sp = SamplingParams(max_new_tokens=6, n=3, seed=0, ignore_eos=True)
    packed = HFEngine(model, tok, compute_dtype="bfloat16").generate([prompt], sp)[0]
    cache = packed_linear.cache_for(model)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert cache.stats["packed"] == n_linear
    plain = HFEngine(model, tok, compute_dtype="bfloat16", packed_weights=False).generate([prompt], sp)[0]
    assert cache.stats["packed"] == n_linear  # the plain engine did not pack
    ids = torch.tensor([prompt + c.token_ids for c in packed])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    for row, (c, p) in enumerate(zip(packed, plain)):
        ref = logp[row, len(prompt) - 1:-1].gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=0.1, rtol=0)
        assert len(p.token_ids) == 6
    HFEngine(model, tok, compute_dtype="bfloat16").generate([prompt], sp)
    assert cache.stats["packed"] == n_linear and cache.stats["reused"] == n_linear  # one cache per model


@needs_packing
def test_frozen_layer_passes_the_input_gradient():
    lin = torch.nn.Linear(16, 24).requires_grad_(False)
    x = torch.randn(2, 5, 16, requires_grad=True)
    gy = torch.randn(2, 5, 24)
    with packed_linear.PackedLinears().installed(lin, frozen_only=True):
        y = lin(x)
    y.backward(gy.to(y.dtype))
    got = x.grad.clone()
    assert got.dtype == torch.float32 and lin.weight.grad is None
    want = gy @ lin.weight.to(torch.bfloat16).float()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    trainable = torch.nn.Linear(16, 24)
    with packed_linear.PackedLinears().installed(trainable, frozen_only=True) as cache:
        assert "forward" not in trainable.__dict__  # a layer that trains keeps its own forward
    assert cache.stats["packed"] == 0


@needs_packing
def test_trainer_gradients_with_packed_frozen_layers_match_autocast(tiny_model_dir):
    from envace_core.config import TrainConfig
    from envace_core.training.trainer import PolicyTrainer

    tok = load_tokenizer(tiny_model_dir)
    trainer = PolicyTrainer(load_model(tiny_model_dir), tok, TrainConfig(lora_r=4, lora_alpha=8),
                            compute_dtype="bfloat16")
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Cancel reservation ABC123, please."}],
                                     add_generation_prompt=True, return_dict=False)
    rows = [(prompt, tok.encode("I will cancel it now.", add_special_tokens=False)),
            (prompt, tok.encode("Which reservation?", add_special_tokens=False))]
    grads = {}
    for packed in (False, True):
        trainer.packed_frozen = packed
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = trainer.completion_ce_backward(rows, 1.0)
        grads[packed] = (loss, torch.cat([p.grad.flatten() for p in trainer._params]))
    (loss0, g0), (loss1, g1) = grads[False], grads[True]
    assert loss1 == pytest.approx(loss0, rel=0.02)
    assert float(torch.cosine_similarity(g0, g1, dim=0)) > 0.99
    assert float((g1 - g0).norm() / g0.norm()) < 0.1
    assert not any("forward" in m.__dict__ for m in trainer.model.modules())


@needs_packing
def test_inference_tensor_weights_are_repacked_every_time():
    with torch.inference_mode():
        net = _net()  # parameters made in inference mode have no version counter
        cache = packed_linear.PackedLinears()
        for _ in range(2):
            with cache.installed(net):
                net(torch.randn(3, 16))
    assert cache.stats["packed"] == 4 and cache.stats["reused"] == 0


@needs_packing
def test_refuses_to_run_where_autograd_records():
    net = _net()
    with pytest.raises(RuntimeError, match="inference_mode"), packed_linear.PackedLinears().installed(net):
        pass
    assert not any("forward" in m.__dict__ for m in net)


@needs_packing
def test_data_writes_need_clear_and_lora_layers_are_repacked_every_time():
    class WithAdapter(torch.nn.Module):  # peft's naming: a frozen base and a small lora_A adapter
        def __init__(self):
            super().__init__()
            self.base_layer, self.lora_A = torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 4, bias=False)

        def forward(self, x):
            return self.lora_A(self.base_layer(x))

    torch.manual_seed(0)
    net, x = WithAdapter(), torch.randn(3, 16)
    cache = packed_linear.PackedLinears()

    def run():
        with torch.inference_mode(), cache.installed(net):
            return net(x).float()

    before = run()
    with torch.no_grad():
        net.base_layer.weight.data.mul_(-1.0)  # `.data`: no version bump, as peft's merge_adapter writes
        net.lora_A.weight.data.mul_(2.0)
    stale = run()
    assert cache.stats["packed"] == 3 and cache.stats["reused"] == 1  # lora_A re-packed, the base reused
    torch.testing.assert_close(stale, 2 * before, atol=0.05, rtol=0.02)  # the base's change is not seen
    cache.clear()
    torch.testing.assert_close(run(), -2 * before, atol=0.05, rtol=0.02)
