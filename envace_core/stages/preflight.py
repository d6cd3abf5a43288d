"""Preflight: checks the configuration, the model reference, the store and the registry before any work starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from envace_core import EnvaceError
from envace_core.config import RunConfig
from envace_core.store.uri import open_store
from envace_core.training.loop import init_adapter_dir


# -------------------------------------------------------------------------------------- preflight
def preflight(cfg: RunConfig, resolve_remote: bool = False) -> None:
    """Check before any work that the model, the artifact store and the registry are usable.

    Cheap checks only (no weights are loaded; an s3:// model is fetched only if `resolve_remote`),
    so a bad path fails in seconds instead of after training. Raises the EnvaceError that names
    the setting to fix.
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
        d = init_adapter_dir(cfg.train.init_adapter)
        if not any((d / sub / "adapter_config.json").is_file() for sub in (".", "act")):
            raise EnvaceError(f"train.init_adapter={cfg.train.init_adapter!r} holds no LoRA adapter "
                              "(adapter_config.json, or act/ and rehearse/ for a per-role policy)")
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            from envace_core.engines.vllm import EngineUnavailableError

            raise EngineUnavailableError("rollout.engine=vllm needs vLLM, which is not installed here: use the "
                                         "train-cuda image or pip install 'envace[gpu]' on a CUDA machine, or "
                                         "set rollout.engine=hf (the transformers engine, CPU)")
