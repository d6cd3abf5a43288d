"""train.lora_target_modules names that peft cannot wrap as a linear LoRA layer: a LoraTargetError naming
the setting, the bad name and the valid ones, from `config --check` (meta model) and from the trainer."""

from __future__ import annotations

import pytest

from envace_core.models import LoraTargetError, check_lora_targets, meta_model

LLAMA_LINEAR = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return meta_model(tiny_model_dir)


@pytest.mark.parametrize("targets, fragment", [
    (["norm"], "'norm' matches 1 module(s) of type LlamaRMSNorm (e.g. model.norm), not torch.nn.Linear"),
    (["q_proj", "input_layernorm"], "'input_layernorm' matches 2 module(s) of type LlamaRMSNorm"),
    (["embed_tokens"], "'embed_tokens' matches 1 module(s) of type Embedding (e.g. model.embed_tokens)"),
    (["mlp"], "of type LlamaMLP (e.g. model.layers.0.mlp)"),
    (["rotary_emb"], "of type LlamaRotaryEmbedding"),
    ([""], "[''] is not a module name (empty)"),
    (["q_proj", "  "], "['  '] is not a module name (empty)"),
    ([], "the list is empty"),
    (["q_proj", "nosuch"], "['nosuch'] match no module of the base model"),
])
def test_a_target_that_is_not_a_linear_layer_is_refused_naming_the_valid_ones(llama, targets, fragment):
    with pytest.raises(LoraTargetError) as e:
        check_lora_targets(targets, llama)
    msg = str(e.value)
    assert msg.startswith(f"train.lora_target_modules={targets}: ")
    assert fragment in msg
    assert msg.endswith(f"its linear layers are named {LLAMA_LINEAR}")


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"],
                                     ["self_attn.q_proj"], ["layers.0.mlp.up_proj"], ["lm_head"]])
def test_linear_targets_pass(llama, targets):
    check_lora_targets(targets, llama)  # peft's list rule: the name or a dotted suffix of it


def test_gpt2_conv1d_layers_are_linear_targets():
    """transformers' Conv1D (GPT-2's linear layer) is wrapped by peft as a LoRA Linear (fan_in_fan_out)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    check_lora_targets(["c_attn", "c_proj"], model)
    with pytest.raises(LoraTargetError, match=r"'ln_f' matches 1 module\(s\) of type LayerNorm.*named c_attn, "
                                              r"c_fc, c_proj, lm_head"):
        check_lora_targets(["ln_f"], model)


def test_layers_peft_already_wrapped_count_as_their_base_layer(tiny_model_dir):
    """get_peft_model wraps layers in place before it fails on a later one; the check after that failure
    still sees q_proj as a linear layer and names only the bad target."""
    from peft import LoraConfig, get_peft_model

    from envace_core.models import load_model

    model = load_model(tiny_model_dir)
    with pytest.raises(ValueError):
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "norm"]))
    assert type(model.model.layers[0].self_attn.q_proj).__module__.startswith("peft")  # half wrapped
    with pytest.raises(LoraTargetError) as e:
        check_lora_targets(["q_proj", "norm"], model)
    assert "'q_proj' matches" not in str(e.value) and "'norm' matches" in str(e.value)
    assert str(e.value).endswith(LLAMA_LINEAR)  # no lora_A/lora_B/base_layer parts among the names


@pytest.mark.parametrize("targets", [["norm"], [""], ["q_proj", "mlp"], ["embed_tokens"]])
def test_the_trainer_raises_the_lora_target_error_not_peft_s(tiny_model_dir, targets):
    from envace_core.config import TrainConfig
    from envace_core.models import load_model, load_tokenizer
    from envace_core.training.trainer import PolicyTrainer

    with pytest.raises(LoraTargetError, match=r"train.lora_target_modules=.*named down_proj"):
        PolicyTrainer(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir),
                      TrainConfig(lora_target_modules=targets), compute_dtype="float32")


@pytest.mark.parametrize("value, fragment", [
    ("[norm]", "'norm' matches 1 module(s) of type LlamaRMSNorm"),
    ("[embed_tokens]", "'embed_tokens' matches 1 module(s) of type Embedding"),
    ('[""]', "[''] is not a module name (empty)"),
])
def test_config_check_refuses_the_target_before_any_work(tiny_model_dir, tmp_path, capsys, value, fragment):
    from envace_core.cli import main

    local = f"model.ref={tiny_model_dir},store.root={tmp_path / 's'},store.registry={tmp_path / 'r'}"
    assert main(["--profile", "test", "--overrides", f"{local},train.lora_target_modules={value}",
                 "config", "--check"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
