"""Shared fixtures: a tiny random-weight Llama built from a config plus the bundled tokenizer."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

import envace_core  # noqa: F401  (sets the offline environment before anything imports tau2)

# flytekit's local task cache for this test session: never the user's, never the repo's .envace/
# (a cached stage from an earlier session could otherwise answer for code the tests just changed).
os.environ.setdefault("ENVACE_FLYTE_CACHE", tempfile.mkdtemp(prefix="envace-test-flyte-cache-"))


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Any attempt to open a non-loopback connection fails the test."""
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith("127.") or host in ("localhost", "::1")) \
                and self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"test tried the network: {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture(scope="session")
def bundled_tokenizer_dir(tmp_path_factory):
    """The SmolLM2 tokenizer read from the bundled GGUF (no weights are dequantised)."""
    from transformers import AutoTokenizer

    from envace_core.models import bundled_gguf_path

    gguf = bundled_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, bundled_tokenizer_dir):
    """A 2-layer, 64-wide random Llama with the bundled tokenizer and chat template, saved as HF files."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    for f in bundled_tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto) on 127.0.0.1 at a free port, for one test module.

    Points the standard AWS environment at it (endpoint, fake credentials, region; no instance
    metadata look-ups, no ~/.aws files), creates an empty bucket `envace-test-<random>` (moto's
    state is per process, so each module gets its own), and yields a namespace with `endpoint`,
    `bucket`, `root` ("s3://<bucket>") and a boto3 `client`.
    The server stops and the environment is restored after the module.
    """
    import uuid
    from types import SimpleNamespace

    import boto3
    from moto.server import ThreadedMotoServer

    nowhere = tmp_path_factory.mktemp("aws") / "absent"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        with pytest.MonkeyPatch.context() as mp:
            for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_RETRY_MODE",
                        "AWS_MAX_ATTEMPTS", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                        "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
                mp.delenv(var, raising=False)
            mp.setenv("AWS_ENDPOINT_URL", endpoint)
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
            mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
            mp.setenv("AWS_CONFIG_FILE", str(nowhere))
            mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
            bucket = f"envace-test-{uuid.uuid4().hex[:8]}"
            # a fresh session, not boto3.client: the default session would cache these fake credentials
            client = boto3.session.Session().client("s3")
            client.create_bucket(Bucket=bucket)
            yield SimpleNamespace(endpoint=endpoint, bucket=bucket, root=f"s3://{bucket}", client=client)
    finally:
        server.stop()


@pytest.fixture
def eval_loads_no_model(monkeypatch):
    """`envace eval` / `run_eval` fail the test if they load a model (for errors that must come first)."""
    from envace_core.evaluation import harness

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad option was reported")

    monkeypatch.setattr(harness, "load_engine", refuse)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch at one thread for a module (use with ``pytest.mark.usefixtures``): tiny models' ops are too small
    to gain from threads, and one thread avoids stalls on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ids_tokenizer():
    """The tokenizer HFEngine needs for token-id prompts on random-vocabulary models: eos = pad = 0."""
    import types

    return types.SimpleNamespace(eos_token_id=0, pad_token_id=0)
