"""The vLLM engine's parts that do not need vLLM: output conversion, sampling settings, merged-weight export
from peft (tied embeddings) and the weight-sync protocol against a recording stand-in for ``vllm.LLM``."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from envace_core.engines.base import SamplingParams
from envace_core.engines.vllm import (
    EngineUnavailableError,
    VLLMEngine,
    WeightSyncError,
    completions_from_output,
    export_merged,
    merged_state_dict,
    sampling_kwargs,
)
from envace_core.models import load_model

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _lora(model, targets=("q_proj", "v_proj")):
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n or "lora_embedding_B" in n:
                p.normal_(0, 0.5)  # B = 0 at init would make the merge a no-op
    return pm


def test_completions_from_output():
    lp = types.SimpleNamespace
    out = types.SimpleNamespace(outputs=[
        types.SimpleNamespace(token_ids=[5, 7, 2], finish_reason="stop",
                              logprobs=[{5: lp(logprob=-0.5)}, {7: lp(logprob=-1.25), 9: lp(logprob=-3.0)},
                                        {2: lp(logprob=-0.1)}]),
        types.SimpleNamespace(token_ids=(4,), finish_reason="length", logprobs=[{4: lp(logprob=-2.0)}]),
    ])
    a, b = completions_from_output(out)
    assert (a.token_ids, a.logprobs, a.finish_reason) == ([5, 7, 2], [-0.5, -1.25, -0.1], "stop")
    assert (b.token_ids, b.logprobs, b.finish_reason) == ([4], [-2.0], "length")
    with pytest.raises(ValueError, match="logprobs=0"):
        completions_from_output(types.SimpleNamespace(outputs=[
            types.SimpleNamespace(token_ids=[1], finish_reason="stop", logprobs=None)]))
    with pytest.raises(ValueError, match="sampled token 3"):
        completions_from_output(types.SimpleNamespace(outputs=[
            types.SimpleNamespace(token_ids=[3], finish_reason="stop", logprobs=[{8: lp(logprob=-1.0)}])]))


def test_sampling_kwargs():
    kw = sampling_kwargs(SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, n=4, seed=3,
                                        stop_token_ids=(11, 2)), eos_token_id=2)
    assert kw == {"ignore_eos": False, "n": 4, "temperature": 0.7, "top_p": 0.9, "max_tokens": 12, "seed": 3,
                  "stop_token_ids": [2, 11], "logprobs": 0, "skip_special_tokens": False, "detokenize": False}
    fixed = sampling_kwargs(SamplingParams(stop_token_ids=(11,), ignore_eos=True), eos_token_id=2)
    assert fixed["ignore_eos"] is True and fixed["stop_token_ids"] == []
    with pytest.raises(ValueError):
        sampling_kwargs(SamplingParams(n=0), None)


def test_merged_export_matches_the_peft_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    pm = _lora(load_model(tiny_model_dir))
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    info = export_merged(pm, tmp_path / "merged", dtype=torch.float32)
    assert info.tied_embeddings and not info.embeddings_changed
    assert all(torch.equal(before[n], p) for n, p in pm.named_parameters())  # the live model is untouched
    state, _ = merged_state_dict(pm, torch.float32)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    assert not any("lora" in k or "base_layer" in k for k in state)
    reloaded = AutoModelForCausalLM.from_pretrained(info.folder, torch_dtype=torch.float32)
    ids = torch.tensor([[1, 50, 300, 7, 9, 120]])
    with torch.no_grad():
        want, got = pm(input_ids=ids).logits, reloaded(input_ids=ids).logits
        base = pm.get_base_model()
        with pm.disable_adapter():
            plain = base(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-4)
    assert not torch.allclose(plain, got, atol=1e-3)  # the adapter really changed the exported weights


class _RecordingLLM:
    def __init__(self):
        self.calls = []

    def collective_rpc(self, method, kwargs=None):
        self.calls.append((method, kwargs))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", None))


def _engine_without_vllm(llm):
    eng = object.__new__(VLLMEngine)  # the sync protocol needs no vLLM import
    eng.llm, eng.stats, eng._loras = llm, {"weight_syncs": 0}, {}
    return eng


def test_sync_reloads_then_resets_prefix_cache(tiny_model_dir, tmp_path):
    info = export_merged(_lora(load_model(tiny_model_dir)), tmp_path / "w")
    llm = _RecordingLLM()
    _engine_without_vllm(llm).sync_weights(info.folder)
    assert llm.calls == [("reload_weights", {"weights_path": str(info.folder)}), ("reset_prefix_cache", None)]


def test_sync_refuses_changed_tied_embeddings_and_empty_folders(tiny_model_dir, tmp_path):
    info = export_merged(_lora(load_model(tiny_model_dir), targets=("q_proj", "embed_tokens")), tmp_path / "e")
    assert info.embeddings_changed and info.tied_embeddings
    llm = _RecordingLLM()
    with pytest.raises(WeightSyncError, match="tied-embedding"):
        _engine_without_vllm(llm).sync_weights(info.folder)
    with pytest.raises(WeightSyncError, match="safetensors"):
        _engine_without_vllm(llm).sync_weights(tmp_path)
    assert llm.calls == []


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_clear_error_without_vllm(tiny_model_dir):
    with pytest.raises(EngineUnavailableError, match=r"envace\[gpu\]"):
        VLLMEngine(tiny_model_dir)


def _fake_vllm(monkeypatch):
    """`_import_vllm` returning a stand-in module whose LLM records the weight-sync calls."""
    import envace_core.engines.vllm as ev

    made = []

    class LLM(_RecordingLLM):
        def __init__(self, model, **kwargs):
            super().__init__()
            self.model, self.kwargs = model, kwargs
            made.append(self)

    monkeypatch.setattr(ev, "_import_vllm", lambda: types.SimpleNamespace(LLM=LLM))
    return made


def test_policy_engine_syncs_merged_weights_after_an_update(tiny_model_dir, tmp_path, monkeypatch):
    """rollout.engine=vllm: the engine starts on an export of the live policy and `sync_from` reloads a
    fresh merged export after the weights change in place (an optimizer step), and only then."""
    from safetensors.torch import load_file

    from envace_core.engines.vllm import PolicyVLLMEngine

    made = _fake_vllm(monkeypatch)
    pm = _lora(load_model(tiny_model_dir))
    eng = PolicyVLLMEngine(pm, _tok(tiny_model_dir), tmp_path, enforce_eager=True)
    (llm,) = made
    assert llm.model == str(tmp_path / "merged") and llm.kwargs["enforce_eager"] and llm.calls == []
    assert eng.sync_from(pm) == 0.0 and llm.calls == []  # unchanged weights: nothing to do
    with torch.no_grad():
        next(p for n, p in pm.named_parameters() if "lora_B" in n).add_(1.0)  # in place, as an optimizer
    eng.sync_from(pm)
    assert [c[0] for c in llm.calls] == ["reload_weights", "reset_prefix_cache"]
    exported = load_file(str(tmp_path / "merged" / "model.safetensors"))
    expected, _ = merged_state_dict(pm)
    assert all(torch.equal(exported[k], v) for k, v in expected.items())


def test_policy_engine_serves_each_roles_adapter(tiny_model_dir, tmp_path, monkeypatch):
    from peft import LoraConfig

    from envace_core.engines.vllm import PolicyVLLMEngine

    made = _fake_vllm(monkeypatch)
    pm = _lora(load_model(tiny_model_dir))
    pm.add_adapter("act", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    pm.add_adapter("rehearse", LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    import sys

    lora_mod = types.ModuleType("vllm.lora.request")
    lora_mod.LoRARequest = lambda name, i, path: types.SimpleNamespace(name=name, id=i, path=path)
    for m in ("vllm", "vllm.lora"):
        monkeypatch.setitem(sys.modules, m, sys.modules.get(m) or types.ModuleType(m))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora_mod)
    eng = PolicyVLLMEngine(pm, _tok(tiny_model_dir), tmp_path)
    (llm,) = made
    assert llm.model == str(tmp_path / "base") and llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] >= 8
    act, reh = eng._lora_for("act"), eng._lora_for("rehearse")
    assert act.path != reh.path and (Path(act.path) / "adapter_config.json").exists()
    assert eng._lora_for("user") is reh and eng._lora_for("self_eval") is act


def _tok(d):
    from envace_core.models import load_tokenizer

    return load_tokenizer(d)


def test_rollout_engine_vllm_is_a_clear_error_without_vllm(tiny_model_dir, monkeypatch):
    import envace_core.engines.vllm as ev
    from envace_core.config import load_config
    from envace_core.training.policy import policy_engine

    def missing():
        raise EngineUnavailableError("VLLMEngine needs vLLM ... pip install 'envace[gpu]'")

    monkeypatch.setattr(ev, "_import_vllm", missing)
    cfg = load_config("test", "rollout.engine=vllm")
    with pytest.raises(EngineUnavailableError, match=r"envace\[gpu\]"):
        policy_engine(cfg, _lora(load_model(tiny_model_dir)), _tok(tiny_model_dir))


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_preflight_stops_rollout_engine_vllm_without_vllm():
    """`envace config --check` / `make train`'s pre-check: no curate and no model load first."""
    from envace_core.config import load_config
    from envace_core.stages.preflight import preflight

    with pytest.raises(EngineUnavailableError, match="rollout.engine=hf"):
        preflight(load_config("test", "rollout.engine=vllm"))


def test_preflight_checks_init_adapter(tmp_path):
    from envace_core import EnvaceError
    from envace_core.config import load_config
    from envace_core.stages.preflight import preflight

    with pytest.raises(EnvaceError, match="is not a directory"):
        preflight(load_config("test", f"train.init_adapter={tmp_path / 'missing'}"))
    with pytest.raises(EnvaceError, match="holds no LoRA adapter"):
        preflight(load_config("test", f"train.init_adapter={tmp_path}"))
