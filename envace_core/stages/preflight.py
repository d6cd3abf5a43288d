"""Preflight: checks the configuration, the model reference, the store and the registry before any work starts."""

from __future__ import annotations

from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.models import AdapterError, check_adapter_dir, read_adapter_config
from envace_core.store.uri import open_store
from envace_core.training.loop import init_adapter_dir


# -------------------------------------------------------------------------------------- preflight
def preflight(cfg: RunConfig, resolve_remote: bool = False) -> None:
    """Check before any work that the model, the artifact store and the registry are usable.

    Cheap checks only (no weights are loaded; an s3:// model is fetched only if `resolve_remote`),
    so a bad path fails in seconds instead of after training. Raises the EnvaceError that names
    the setting to fix (`check_init_adapter` for `train.init_adapter`).
    """
    from envace_core.models import BUNDLED, bundled_gguf_path, resolve_model
    from envace_core.store.registry import Registry

    if cfg.model.ref == BUNDLED:
        bundled_gguf_path()
    elif not cfg.model.ref.startswith("s3://") or resolve_remote:
        resolve_model(cfg.model.ref)
    open_store(cfg.store.root).check()
    Registry(cfg.store.registry)
    if cfg.train.init_adapter and not cfg.train.init_adapter.startswith("s3://"):
        check_init_adapter(cfg)
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            from envace_core.engines.vllm import EngineUnavailableError

            raise EngineUnavailableError("rollout.engine=vllm needs vLLM, which is not installed here: use the "
                                         "train-cuda image or pip install 'envace[gpu]' on a CUDA machine, or "
                                         "set rollout.engine=hf (the transformers engine, CPU)")


def check_init_adapter(cfg: RunConfig) -> None:
    """Check a local `train.init_adapter` the way the train stage will load it (`training.loop.
    load_init_adapter`), reading configs and safetensors headers only: `models.check_adapter_dir` (config
    fields, weights present, not truncated, LoRA ranks that match the config), then the layout and LoRA
    settings against `train.*`: per-role act/ and rehearse/ folders exactly when `train.policy_per_role`,
    and each folder's (r, lora_alpha, target_modules) equal to (train.lora_r, train.lora_alpha,
    train.lora_target_modules).

    Raises `EnvaceError` (no folder / no adapter at the path) or `models.AdapterError` naming the file and
    the setting."""
    ref = cfg.train.init_adapter
    d = init_adapter_dir(ref)
    if not any((d / sub / "adapter_config.json").is_file() for sub in (".", "act", "rehearse")):
        raise EnvaceError(f"train.init_adapter={ref!r} holds no LoRA adapter "
                          "(adapter_config.json, or act/ and rehearse/ for a per-role policy)")
    try:
        dirs = check_adapter_dir(d)
    except AdapterError as e:
        raise AdapterError(f"train.init_adapter={ref!r}: {e}") from None
    per_role = len(dirs) == 2
    if per_role != cfg.train.policy_per_role:
        have = "per-role act/ and rehearse/ adapters" if per_role else "one shared adapter"
        raise AdapterError(f"train.init_adapter={ref!r} holds {have}, but train.policy_per_role="
                           f"{str(cfg.train.policy_per_role).lower()}; set train.policy_per_role="
                           f"{str(per_role).lower()} or give an adapter of that layout")
    t = cfg.train
    ours = (t.lora_r, t.lora_alpha, sorted(t.lora_target_modules))
    for one in dirs:
        conf = read_adapter_config(one / "adapter_config.json")
        tm = conf.get("target_modules")
        theirs = (conf.get("r"), conf.get("lora_alpha"), sorted(tm) if isinstance(tm, list) else tm)
        if theirs != ours:
            raise AdapterError(f"train.init_adapter={ref!r}: {one / 'adapter_config.json'} has (r, lora_alpha, "
                               f"target_modules) = {theirs}, but train.* has (lora_r, lora_alpha, "
                               f"lora_target_modules) = {ours}; use the adapter's LoRA settings")
