import pytest

from envace_core.models import (
    ModelNotFoundError,
    load_model,
    load_tokenizer,
    resolve_model,
)


def test_tiny_model_loads_and_generates(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_model(resolve_model(str(tiny_model_dir)))
    import torch

    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 3


@pytest.mark.parametrize("ref", ["/no/such/dir", "bundled:gpt-5"])
def test_bad_model_ref_names_the_fix(ref):
    with pytest.raises(ModelNotFoundError, match="model|bundled"):
        resolve_model(ref)


def test_policy_device_is_cpu_without_cuda_and_cuda_is_refused_clearly(monkeypatch):
    import torch

    from envace_core import EnvaceError
    from envace_core.training.policy import policy_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert policy_device("auto") == torch.device("cpu")
    assert policy_device("cpu") == torch.device("cpu")
    with pytest.raises(EnvaceError, match="model.device=cuda"):
        policy_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert policy_device("auto") == torch.device("cuda", 3)  # the launcher's GPU, not always cuda:0
