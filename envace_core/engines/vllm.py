"""The vLLM generation engine (GPU; the ``[gpu]`` extra). Same interface as `HFEngine`: token ids +
`SamplingParams` in, `Completion` (token ids + behaviour log-probs) out.

* Prefix caching is on (a GRPO group's n samples and a trajectory's later turns reuse the prompt's KV).
* Weight sync after a training step, without restarting the engine (VLLM_NOTES.md): `export_merged` writes
  the policy's LoRA-merged weights to a folder, `VLLMEngine.sync_weights` calls
  ``collective_rpc("reload_weights", kwargs={"weights_path": folder})`` then ``reset_prefix_cache()`` (cached
  KV was computed with the old weights).
* Tied embeddings: a reload was seen to keep the old output layer when the embeddings changed
  (VLLM_NOTES.md). LoRA-merged weights leave embeddings alone; `export_merged` reports whether the
  embeddings changed and `sync_weights` refuses such a folder for a tied model (`WeightSyncError`).
* LoRA serving, the alternative sync path: `VLLMEngine.load_lora` serves a saved peft adapter; every
  request of a call then uses that one adapter (a batch mixing adapters/no adapter was seen to apply one
  adapter to all, VLLM_NOTES.md, so calls never mix).

vLLM is imported lazily: importing this module needs only torch; constructing `VLLMEngine` without vLLM
raises `EngineUnavailableError`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from envace_core import EnvaceError
from envace_core.engines.base import (
    ROLE_ADAPTERS,
    Completion,
    SamplingParams,
    check_constraints,
    check_prompt_seeds,
    prompt_budgets,
)


class EngineUnavailableError(EnvaceError):
    """The engine's library is not installed (vLLM: the ``[gpu]`` extra on a CUDA machine)."""


class WeightSyncError(EnvaceError):
    """A weight folder cannot be synced into the running engine; the message says why and what to do."""


def _import_vllm():
    try:
        import vllm
    except ImportError as e:  # also raised for a broken install (e.g. mismatched torchvision)
        raise EngineUnavailableError(
            "VLLMEngine needs vLLM, which is not importable here "
            f"({type(e).__name__}: {e}). Install the GPU extra on a CUDA machine: pip install 'envace[gpu]' "
            "(or rollout.engine=hf: the transformers engine, engines.hf.HFEngine, on CPU).") from e
    return vllm


# ---------------------------------------------------------------------------------------------- conversion
def sampling_kwargs(params: SamplingParams, eos_token_id: int | None) -> dict:
    """Keyword arguments for ``vllm.SamplingParams`` equivalent to `params`.

    temperature 0 is greedy in both; ``logprobs=0`` returns the sampled token's log-prob only; the tokenizer's
    eos and ``params.stop_token_ids`` end a sample and stay in its ids (as in `HFEngine`).
    Raises ValueError for the invalid params `HFEngine` rejects (n < 1, max_new_tokens < 1 here: vLLM
    cannot generate 0 tokens, temperature < 0, top_p outside (0, 1]).
    """
    if params.n < 1 or params.max_new_tokens < 1 or params.temperature < 0 or not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"invalid SamplingParams for vLLM: {params}")
    stop = sorted({int(t) for t in params.stop_token_ids} | ({int(eos_token_id)} if eos_token_id is not None
                                                              else set()))
    if params.ignore_eos:
        stop = []
    return {"ignore_eos": bool(params.ignore_eos), "n": params.n, "temperature": float(params.temperature), "top_p": float(params.top_p),
            "max_tokens": int(params.max_new_tokens), "seed": params.seed, "stop_token_ids": stop,
            "logprobs": 0, "skip_special_tokens": False, "detokenize": False}


def completions_from_output(output: Any) -> list[Completion]:
    """`Completion`s from one vLLM ``RequestOutput`` (its ``outputs``: ``token_ids``, ``logprobs`` = one
    {token id: Logprob(logprob=...)} dict per generated token, ``finish_reason`` "stop" | "length").

    Raises ValueError when a sample lacks log-probs (the request lacked logprobs=0) or the log-prob dict of
    a position does not hold the sampled token.
    """
    out = []
    for s in output.outputs:
        ids = [int(t) for t in s.token_ids]
        if s.logprobs is None or len(s.logprobs) != len(ids):
            raise ValueError("vLLM output has no log-prob per generated token: request logprobs=0")
        lps = []
        for tid, pos in zip(ids, s.logprobs):
            if tid not in pos:
                raise ValueError(f"vLLM log-probs at a position do not hold the sampled token {tid}")
            lp = pos[tid]
            lps.append(float(getattr(lp, "logprob", lp)))
        reason = "stop" if s.finish_reason == "stop" else "length"
        out.append(Completion(token_ids=ids, logprobs=lps, finish_reason=reason))
    return out


# ---------------------------------------------------------------------------------------------- weight export
@dataclass(frozen=True)
class ExportInfo:
    """What `export_merged` wrote: folder, tensor count, and whether input embeddings / output layer differ
    from the base model's (True forbids a reload into a tied-embedding engine)."""

    folder: Path
    tensors: int
    embeddings_changed: bool
    tied_embeddings: bool


def _base_name(name: str) -> str:
    """peft parameter name -> the base model's (``base_model.model.`` prefix and ``.base_layer`` dropped)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def merged_state_dict(model, dtype: torch.dtype = torch.bfloat16) -> tuple[dict[str, torch.Tensor], bool]:
    """The weights of ``model`` (a peft ``PeftModel`` with LoRA, or a plain HF causal LM) with the active
    adapter merged, without modifying ``model``: W' = W + ΔW per LoRA layer (ΔW = peft's
    ``get_delta_weight``, i.e. scaling · B A; LoRA, Hu et al. 2021 §4.1).

    Returns (base-model name -> tensor in `dtype`, each shape as in the base model; a tied ``lm_head`` is left
    out as HF checkpoints do; embeddings_changed: whether an adapter targets the input embeddings or the
    output layer). One merged layer at a time is materialised (besides the returned copy).
    Raises WeightSyncError for peft ``modules_to_save`` copies (not supported: sync through LoRA serving).
    """
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, torch.Tensor] = {}
    embeddings_changed = False
    active = getattr(model, "active_adapter", None)
    for mname, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and (active in mod.lora_A or active in mod.lora_embedding_A):
            deltas[_base_name(mname + ".base_layer.weight")] = mod.get_delta_weight(active)
            embeddings_changed |= mname.endswith(("embed_tokens", "lm_head", "wte"))
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name or "original_module" in name:
                raise WeightSyncError(f"{name}: peft modules_to_save is not supported by export_merged")
            if "lora_" in name:
                continue
            base = _base_name(name)
            if tied and base == "lm_head.weight":
                continue
            w = p.detach()
            if base in deltas:
                w = w.float() + deltas.pop(base).float()
            out[base] = w.to(dtype).contiguous().clone()
    return out, embeddings_changed


def export_merged(model, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> ExportInfo:
    """Write ``model``'s merged weights (`merged_state_dict`) as ``model.safetensors`` + ``config.json`` into
    `folder`, atomically (`storage.atomic_dir`: readers never see a partial folder).

    Returns an `ExportInfo`. Raises OSError on write failure (nothing is left under `folder`).
    """
    from safetensors.torch import save_file

    from envace_core.store.files import atomic_dir

    state, changed = merged_state_dict(model, dtype)
    cfg = getattr(model, "config", None)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))

    def build(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if cfg is not None:
            cfg.save_pretrained(tmp)
        (tmp / "envace_export.json").write_text(json.dumps(
            {"embeddings_changed": changed, "tied_embeddings": tied, "tensors": len(state)}))

    final = atomic_dir(folder, build, exists="replace")
    return ExportInfo(folder=final, tensors=len(state), embeddings_changed=changed, tied_embeddings=tied)


# ---------------------------------------------------------------------------------------------- the engine
class VLLMEngine:
    """Generate with vLLM's offline ``LLM`` from token ids (``TokensPrompt``), prefix caching on.

    Args:
        model_path: an HF model folder (the base policy; a merged export from `export_merged` also works).
        tokenizer: the policy's HF tokenizer (its eos ends samples); loaded from `model_path` when None.
        dtype: vLLM's dtype ("bfloat16").
        enable_lora: serve LoRA adapters (`load_lora`); max_lora_rank must cover the adapters' rank.
        logprobs_mode: vLLM's; "processed_logprobs" gives log softmax(logits / T) of the sampled token, as
            `Completion.logprobs` specifies (vLLM renormalises over the top-p nucleus when top_p < 1;
            `HFEngine` does not).
        llm: an already-built ``vllm.LLM`` (tests, sharing); then the other engine settings are ignored.
        **llm_kwargs: passed to ``vllm.LLM`` (gpu_memory_utilization, max_model_len, enforce_eager, ...).
    Raises:
        EngineUnavailableError: vLLM is not importable.
    """

    def __init__(self, model_path: str | Path, tokenizer=None, *, dtype: str = "bfloat16",
                 enable_lora: bool = False, max_lora_rank: int = 16, logprobs_mode: str = "processed_logprobs",
                 llm=None, **llm_kwargs):
        self._vllm = _import_vllm()
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        if llm is None:
            lora = {"enable_lora": True, "max_lora_rank": max_lora_rank} if enable_lora else {}
            # Prompts go in as token ids and come back as ids (detokenize=False), with eos passed as a stop
            # id: vLLM needs no tokenizer, so weight folders (export_merged) need none either.
            llm_kwargs.setdefault("skip_tokenizer_init", True)
            llm = self._vllm.LLM(model=self.model_path, dtype=dtype, enable_prefix_caching=True,
                                 logprobs_mode=logprobs_mode, **lora, **llm_kwargs)
        self.llm = llm
        self._loras: dict[str, Any] = {}
        self._lora_ids = 0
        self.stats: dict = {"generated_tokens": 0, "seconds": 0.0, "calls": 0, "weight_syncs": 0}
        self._warned_constraints = False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt (B lists, input order), as `Engine.generate`.

        With LoRA adapters loaded, every request of the call uses the adapter of ``params.role``
        (`ROLE_ADAPTERS`; the only adapter when one is loaded). ``params.prompt_max_new_tokens`` becomes each
        request's own ``max_tokens``; a prompt whose budget is 0 gets empty completions and sends no request.
        Raises ValueError for invalid params, an empty prompt or ``prompt_seeds`` / ``prompt_max_new_tokens``
        of another length than `prompts`.
        """
        import time

        from vllm.inputs import TokensPrompt

        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token id")
        check_prompt_seeds(params, len(prompts))
        check_constraints(params, len(prompts))
        budgets = prompt_budgets(params, len(prompts))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        # n, temperature, top_p checked even when no prompt decodes (all budgets 0)
        kw = sampling_kwargs(replace(params, max_new_tokens=max(budgets + [1])), eos)
        live = [i for i, b in enumerate(budgets) if b > 0]
        result: list[list[Completion]] = [[Completion([], [], "length") for _ in range(params.n)] for _ in prompts]
        if not live:
            return result
        if params.constraints is not None and any(params.constraints) and not self._warned_constraints:
            self._warned_constraints = True  # Python-side constraints on decoded text: not a vLLM logits mask
            logging.getLogger(__name__).warning(
                "vLLM engine: SamplingParams.constraints are not applied; samples are drawn unconstrained "
                "(set rollout.constrained_decoding=false to say so in the config)")
        t0 = time.perf_counter()
        # per-prompt seeds (`SamplingParams.prompt_seeds`) and budgets: one vLLM SamplingParams per request,
        # each with its call's seed and its own max_tokens, as that call alone would have sent it
        if params.prompt_seeds is None and params.prompt_max_new_tokens is None:
            sp = self._vllm.SamplingParams(**kw)
        else:
            seeds = params.prompt_seeds
            sp = [self._vllm.SamplingParams(**{**kw, "seed": seeds[i][0] if seeds is not None else kw["seed"],
                                               "max_tokens": budgets[i]}) for i in live]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in live], sp,
                                 lora_request=self._lora_for(params.role), use_tqdm=False)
        for i, o in zip(live, outs):
            result[i] = completions_from_output(o)
        self.stats["generated_tokens"] += sum(len(c.token_ids) for r in result for c in r)
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["calls"] += 1
        return result

    def _lora_for(self, role: str | None):
        if not self._loras:
            return None
        if len(self._loras) == 1:
            return next(iter(self._loras.values()))
        return self._loras.get(ROLE_ADAPTERS.get(getattr(role, "value", role), "act"))

    def sync_weights(self, folder: str | Path) -> float:
        """Load the weights in `folder` (an `export_merged` folder) into the running engine, then drop the
        prefix cache. Returns seconds taken.

        Raises WeightSyncError: the folder has no safetensors, or its export changed the embeddings of a
        tied-embedding model (vLLM's reload keeps the old output layer then: restart the engine on the
        folder, or sync through `load_lora`).
        """
        import time

        folder = Path(folder)
        if not list(folder.glob("*.safetensors")):
            raise WeightSyncError(f"{folder} holds no *.safetensors: write it with engines.vllm.export_merged")
        meta_path = folder / "envace_export.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if meta.get("embeddings_changed") and meta.get("tied_embeddings"):
            raise WeightSyncError(
                f"{folder}: the embeddings changed on a tied-embedding model; vLLM's reload_weights would keep "
                "the old output layer. Restart the engine on this folder or sync through load_lora instead.")
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        self.llm.reset_prefix_cache()
        self.stats["weight_syncs"] += 1
        return time.perf_counter() - t0

    def load_lora(self, adapter_dir: str | Path, name: str = "act") -> None:
        """Serve the peft adapter saved in `adapter_dir` (``save_pretrained``) as `name` for later calls;
        replacing a name gives it a fresh id so vLLM does not reuse the old adapter or its cached prefixes."""
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        self._loras[name] = LoRARequest(f"{name}-{self._lora_ids}", self._lora_ids, str(adapter_dir))

    def clear_loras(self) -> None:
        """Generate with the engine's own weights again (e.g. after switching to merged-weight sync)."""
        self._loras.clear()


# ------------------------------------------------------------------------------- serving a trained policy
class PolicyVLLMEngine(VLLMEngine):
    """A `VLLMEngine` that serves a live (peft) policy being trained in this process (``rollout.engine=vllm``).

    Started on an `export_merged` copy of `policy` in `workdir`; `sync_from(policy)` after each optimizer step
    brings the engine up to date without a restart: for a single-adapter policy by exporting the merged
    weights and `sync_weights` (reload + prefix-cache reset), for a per-role policy (two adapters,
    `ROLE_ADAPTERS`) by saving both adapters and serving them with `load_lora`, so every role generates with
    its own adapter. `sync_from` is a no-op when the weights did not change since the last sync (parameter
    version counters, as `HFEngine`'s prefix cache uses).

    Args:
        policy: the policy (plain HF model or ``PeftModel``) whose weights to serve.
        tokenizer: its tokenizer.
        workdir: a folder for the exported weights/adapters (created; reused across syncs).
        **kwargs: passed to `VLLMEngine` (dtype, gpu_memory_utilization, max_model_len, enforce_eager, ...).
    Raises:
        EngineUnavailableError: vLLM is not importable.
    """

    def __init__(self, policy, tokenizer, workdir: str | Path, **kwargs):
        from envace_core.engines.base import role_adapter
        from envace_core.engines.prefix_cache import weights_fingerprint

        self._fp = weights_fingerprint
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.per_role = role_adapter(policy, "rehearse") is not None
        if self.per_role:  # serve the frozen base; adapters go through LoRA requests
            base = policy.get_base_model()
            rank = max(int(c.r) for c in policy.peft_config.values())
            with policy.disable_adapter():
                export_merged(base, self.workdir / "base")
            kwargs = {"enable_lora": True, "max_lora_rank": max(rank, kwargs.pop("max_lora_rank", 16)), **kwargs}
            super().__init__(self.workdir / "base", tokenizer, **kwargs)
        else:
            export_merged(policy, self.workdir / "merged")
            super().__init__(self.workdir / "merged", tokenizer, **kwargs)
        self._synced = None
        self.sync_from(policy)

    def sync_from(self, policy) -> float:
        """Make the engine generate with `policy`'s current weights; returns seconds taken (0 if unchanged)."""
        import time

        fp = self._fp(policy, torch.float32)[0]
        if fp == self._synced:
            return 0.0
        t0 = time.perf_counter()
        if self.per_role:
            for name in sorted(set(ROLE_ADAPTERS.values())):
                out = self.workdir / f"adapter-{name}-{self.stats['weight_syncs']}"
                policy.save_pretrained(str(out), selected_adapters=[name])
                sub = out / name if (out / name / "adapter_config.json").exists() else out
                self.load_lora(sub, name)
            self.stats["weight_syncs"] += 1
        elif self._synced is not None:  # the first export is what the engine started on
            self.sync_weights(export_merged(policy, self.workdir / "merged").folder)
        self._synced = fp
        return time.perf_counter() - t0
