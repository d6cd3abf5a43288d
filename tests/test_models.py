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


def test_an_s3_model_is_fingerprinted_from_its_listing_as_its_download_is(s3_server, tmp_path, monkeypatch):
    """register's base_model.sha256 for an s3:// model needs no download, and equals what load_engine
    computes (models.model_fingerprint) on the downloaded folder; a rewritten weight file changes it."""
    from envace_core.models import S3_SOURCE, base_model_lineage, model_fingerprint

    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    put = lambda k, b: s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"models/fp/{k}", Body=b)  # noqa: E731
    put("config.json", b"{}")
    put("model.safetensors", b"weights")
    put("tokenizer/vocab.json", b"{}")
    uri = f"{s3_server.root}/models/fp"
    rec = base_model_lineage(uri)
    assert rec["fingerprint"] == "s3-listing" and rec["ref"] == uri and not (tmp_path / "cache").exists()
    local = resolve_model(uri)
    assert (local / "model.safetensors").read_bytes() == b"weights" and (local / "tokenizer/vocab.json").is_file()
    assert (local / S3_SOURCE).is_file() and model_fingerprint(local) == rec["sha256"]
    put("model.safetensors", b"other weights")
    assert base_model_lineage(uri)["sha256"] != rec["sha256"]
    with pytest.raises(ModelNotFoundError, match="holds no config.json"):
        base_model_lineage(f"{s3_server.root}/models/none")
