"""The policy being trained: device choice, base model + LoRA adapter(s) as a `PolicyTrainer`, the engine that samples from it, rollout parameters."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Optional

from envace_core import EnvaceError
from envace_core.config import ConfigError, RunConfig, apply_setting
from envace_core.models import (
    ModelRefError,
    ResolvedModel,
    adapter_load_error,
    check_adapter_dir,
)

if TYPE_CHECKING:
    import torch


def load_engine(cfg: RunConfig, model: ResolvedModel):
    """(HFEngine, parameter count) for `model`.

    Raises:
        ModelRefError: `model.base_ref` is no valid model.ref (named as ``--model``), or a registry model's
            base weights differ from the manifest's ``base_model.sha256`` (`models.model_fingerprint`).
    """
    from envace_core.models import model_fingerprint

    cfg = cfg.model_copy(deep=True)
    flag = "--model" if model.base_ref == model.ref else f"--model {model.ref!r}: its base model"
    try:
        apply_setting(cfg, "model.ref", model.base_ref, flag)
    except ConfigError as e:  # ModelRefError: the evaluation harness names the flag it came from
        raise ModelRefError(str(e)) from None
    policy, tok, base_dir = load_policy(cfg, model.adapter_dir)
    want = ((model.manifest or {}).get("base_model") or {}).get("sha256")
    if want and model_fingerprint(base_dir) != want:
        raise ModelRefError(f"--model {model.ref!r}: the base model {model.base_ref} at {base_dir} is not the one "
                            "it was trained on (weights sha256 differs from the manifest's base_model.sha256)")
    n_params = sum(p.numel() for p in policy.parameters())
    return policy_engine(cfg, policy, tok), n_params


# ---------------------------------------------------------------------------------------- policy
def policy_device(device: str = "auto") -> torch.device:
    """cuda:$LOCAL_RANK (the launcher's local rank, 0 without one) or cpu, per `model.device`.

    Raises:
        EnvaceError: model.device=cuda on a machine without CUDA.
    """
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EnvaceError("model.device=cuda but torch sees no CUDA device (CPU wheel or no GPU); "
                          "use model.device=auto or cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))


def load_policy(cfg: RunConfig, adapter_dir: Optional[str] = None):
    """(model, tokenizer, base model dir) for the configured base, with a LoRA adapter if given.

    A per-role policy's adapter directory (act/ and rehearse/, `train.policy_per_role`) loads both
    as named adapters; engines over it then generate each role with its own (`ROLE_ADAPTERS`).
    Raises `models.AdapterError` (before the base loads) for a missing or damaged adapter folder, and
    after it when the adapter's weights do not fit the base ``model.ref``.
    """
    from envace_core.models import (
        load_model,
        load_tokenizer,
        resolve_model,
    )

    dirs = check_adapter_dir(adapter_dir) if adapter_dir else []
    base = resolve_model(cfg.model.ref)
    model, tok = load_model(base), load_tokenizer(base)
    model.to(policy_device(cfg.model.device))
    if dirs:
        from peft import PeftModel

        try:  # peft's own errors (size mismatch, ...) say nothing about which folder or base
            if len(dirs) == 2:
                model = PeftModel.from_pretrained(model, str(dirs[0]), adapter_name="act")
                model.load_adapter(str(dirs[1]), adapter_name="rehearse")
                model.set_adapter("act")
            else:
                model = PeftModel.from_pretrained(model, str(dirs[0]))
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise adapter_load_error(adapter_dir, cfg.model.ref, e) from e
    model.eval()
    return model, tok, base


def policy_engine(cfg: RunConfig, model, tok):
    """The rollout engine over the policy: `rollout.engine` "hf" (default) is the transformers engine with
    the configured dtype and prefix KV cache, on the live weights; "vllm" is `engines.vllm.PolicyVLLMEngine`
    started on an export of the current weights (callers that update the policy call its ``sync_from``)."""
    if cfg.rollout.engine == "vllm":
        from envace_core.engines.vllm import PolicyVLLMEngine

        workdir = tempfile.mkdtemp(prefix="envace-vllm-")
        return PolicyVLLMEngine(model, tok, workdir, **cfg.rollout.vllm_kwargs)
    from envace_core.engines.hf import HFEngine

    return HFEngine(model, tok, compute_dtype=cfg.model.compute_dtype, max_batch_size=cfg.rollout.max_batch_size,
                    prefix_cache_tokens=cfg.rollout.prefix_cache_tokens)


def rollout_params(cfg: RunConfig, temperature: Optional[float] = None, max_turns: Optional[int] = None,
                   lenient: Optional[bool] = None):
    """`RolloutParams` from ``cfg.rollout`` (token budgets, observation/prompt bounds, tool-format mode via
    `rollout.params_from_config`), with `temperature`, `max_turns` and `lenient` (the ACT parser's
    lenient tool-format mode) overridden where given, e.g. by the ``eval.*`` settings."""
    from dataclasses import replace

    from envace_core.training.rollout import RolloutParams, params_from_config

    r = cfg.rollout
    p = params_from_config(cfg, RolloutParams(
        max_turns=max_turns or r.max_turns, max_new_tokens_act=r.max_new_tokens_act,
        max_new_tokens_rehearse=r.max_new_tokens_rehearse,
        temperature=r.temperature if temperature is None else temperature, top_p=r.top_p))
    return p if lenient is None else replace(p, lenient=lenient)


def rehearsal_params(cfg: RunConfig, max_turns: int):
    """`RolloutParams` of ACT and REHEARSE inside Private Rehearsal's imagined trajectories: `rollout_params`
    at ``rehearsal.temperature`` for `max_turns` turns, format-constrained only with
    ``rehearsal.constrained_decoding`` (METHOD.md §4)."""
    from dataclasses import replace

    p = rollout_params(cfg, temperature=cfg.rehearsal.temperature, max_turns=max_turns)
    return replace(p, constrained=p.constrained and cfg.rehearsal.constrained_decoding)
