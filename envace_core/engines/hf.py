"""The transformers generation engine: the CPU default and the engine the tests use.

Its own decoding loop (not ``model.generate``) so that it can

* prefill each distinct prompt once and fan the KV cache out ``n`` ways (a GRPO group shares one prompt),
* record the behaviour log-prob of every sampled token (float32, of the full distribution), and
* batch prompts of different lengths with left padding and explicit position ids, so that a prompt's
  completion does not depend on what it is batched with.

It always runs on the live weights of ``model`` (a plain HF causal LM or a peft ``PeftModel``): the trainer
updates that same object in place between calls, and nothing is copied.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import time
from contextlib import nullcontext

import torch

from envace_core.engines import (
    cpu_attention,
    fused_decode,
    packed_linear,
    shared_prefix,
)
from envace_core.engines.base import (
    Completion,
    SamplingParams,
    check_constraints,
    check_prompt_seeds,
    prompt_budgets,
    resolve_compute_dtype,
    role_adapter,
)
from envace_core.engines.constrained_sampling import constrain_step
from envace_core.engines.prefix_cache import (
    PrefixPool,
    common_prefix,
    padded_past,
    weights_fingerprint,
)

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}


def _full_attention(cache) -> bool:
    """Whether every layer of a transformers cache is a full-attention `DynamicLayer` (whose KV can be
    padded, selected and stored per row; sliding-window and hybrid layers cannot)."""
    return all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)


def _cache_holding(past: list[tuple[torch.Tensor, torch.Tensor]], config):
    """A transformers `DynamicCache` whose layers hold `past`'s (keys, values) tensors as they are.

    ``DynamicCache(past)`` fills each layer through ``update``, which concatenates the tensors onto an empty
    one: a copy of the whole reused KV (float32 after rotary embeddings, ~92 MB for 2 000 tokens of
    SmolLM2-135M) made only to be concatenated once more by the next forward. Falls back to that constructor
    when the config's cache is not all full-attention `DynamicLayer`s or has another number of layers."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if len(cache.layers) != len(past) or not _full_attention(cache):
        return DynamicCache(past, config=config)
    for layer, (k, v) in zip(cache.layers, past):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


# Distinct prompts that begin with at least this many common tokens decode with that root's KV read once
# for all of them (`shared_prefix.SharedPrefixCache(root=...)`): below it the extra products cost more
# than the reads they save.
_MIN_SHARED_ROOT = 64


def _row_seed(base: int, prompt_idx: int, sample_idx: int) -> int:
    """A 63-bit seed for sample `sample_idx` of prompt `prompt_idx`, derived from the call's seed."""
    digest = hashlib.blake2b(f"{base}:{prompt_idx}:{sample_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of highest-probability tokens whose mass reaches `top_p`.

    probs: (S, V) float32 probabilities. Returns (S, V), unnormalised (the sampler does not need it).
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)  # the top token always survives
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


class HFEngine:
    """Generate with a transformers causal LM (optionally peft-wrapped) through a hand-written decode loop.

    Args:
        model: a ``transformers`` causal LM or a peft ``PeftModel`` around one. Used by reference: weight
            updates made to it after construction are seen by the next ``generate``.
        tokenizer: its HF tokenizer; ``tokenizer.eos_token_id`` always ends a sample.
        compute_dtype: "bfloat16" runs forwards under ``torch.autocast`` in bf16. The model's weights are not
            touched (e.g. float32 masters): each ``generate`` call casts the ``nn.Linear`` weights once into a
            transient bf16 copy (~2 bytes/param, freed on return) and, on CPU with SDPA attention, runs the
            one-token decode attention in float32 (bf16 SDPA decode is several times slower on CPU).
            "float32" runs without autocast ("float16" is accepted for CUDA).
        max_batch_size: the most sequences held by one decode forward (prefill holds at most
            ``max(1, max_batch_size // n)`` distinct prompts).
        prefix_cache_tokens: 0 (default) re-encodes every prompt. > 0 keeps the KV caches of finished samples
            (up to this many tokens in all, LRU; see `engines.prefix_cache`), and a prompt sharing a token
            prefix with one of them prefills only the tokens after that prefix: a multi-turn trajectory's
            next turn extends its cache instead of re-encoding the history. Same tokens and log-probs as
            re-encoding up to floating-point rounding (the prefix's KV is computed in a different batch
            shape). Emptied automatically when the weights change in place; only for models whose cache
            layers are all full-attention (`DynamicLayer`), otherwise ignored.
        shared_prefix_decode: True (default) decodes through `engines.shared_prefix`: each prompt's KV is
            kept once and attended once by all of its samples, and each sample appends only its own tokens
            (no per-step copy of the cache), in float32 on CPU unless packed weights are in use (then the
            prompts' part in bf16; the samples' own tokens and the softmax in float32). Distinct prompts
            that begin with the same >= 64 tokens read that root's KV once for all of them. Same tokens and
            log-probs as the plain path up to summation order and rounding; used only for the model
            families `shared_prefix.supports` lists.
        packed_weights: True (default) runs the ``nn.Linear`` layers on oneDNN-packed bf16 copies of their
            weights for bf16 compute on CPU where `packed_linear.available` (kept across calls, re-packed
            when a weight changes in place), instead of a bf16 copy per call, and each peft LoRA layer on a
            packed copy of its merged weight (re-merged when the adapter changes); ignored elsewhere.
        fused_decode: True (default) runs each shared-prefix decode step through `engines.fused_decode.step`
            (the model's own modules in one loop over the layers: the same logits as the transformers forward
            with less Python per token) for the families `fused_decode.supports` lists, when no per-call
            weight copies are in use; False keeps the transformers forward.

    Attributes:
        stats: cumulative counters over all calls: ``prompt_tokens`` (tokens prefilled, each distinct prompt
            counted once per call), ``cached_tokens`` (prompt tokens taken from the prefix cache instead),
            ``generated_tokens`` (tokens in returned completions), ``seconds`` (wall
            time inside ``generate``), ``calls``.

    Raises:
        ValueError: unknown ``compute_dtype``, ``max_batch_size`` < 1 or ``prefix_cache_tokens`` < 0.
    """

    def __init__(self, model, tokenizer, compute_dtype: str = "bfloat16", max_batch_size: int = 8,
                 prefix_cache_tokens: int = 0, shared_prefix_decode: bool = True, packed_weights: bool = True,
                 fused_decode: bool = True):
        if compute_dtype == "auto":
            compute_dtype = resolve_compute_dtype("auto", next(model.parameters()).device.type)
        if isinstance(compute_dtype, torch.dtype):
            dtype = compute_dtype
        elif compute_dtype in _DTYPES:
            dtype = _DTYPES[compute_dtype]
        else:
            raise ValueError(f"compute_dtype must be one of {sorted(_DTYPES)}, got {compute_dtype!r}")
        if int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.compute_dtype = dtype
        self.max_batch_size = int(max_batch_size)
        if int(prefix_cache_tokens) < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self.prefix_pool: PrefixPool | None = PrefixPool(prefix_cache_tokens) if prefix_cache_tokens else None
        self._shared_prefix = bool(shared_prefix_decode)
        self._packed_weights = bool(packed_weights)
        self._fused_decode = bool(fused_decode)
        self._unpadded = True  # `_prefill_unpadded` until a model's cache proves it cannot be padded
        # constraint_refusals: drawn tokens a constraint refused (redrawn); constraint_dead_rows: samples
        # ended because no tried token was allowed (`SamplingParams.constraints`)
        self.stats: dict = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "seconds": 0.0,
                            "calls": 0, "constraint_refusals": 0, "constraint_dead_rows": 0}
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        fwd_params = inspect.signature(hf.forward).parameters
        # transformers 5.x renames `past_key_values` to `cache` (the old name is deprecated).
        self._cache_kw = "cache" if "cache" in fwd_params else "past_key_values"
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in fwd_params), None)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix and the model's packed weight copies (needed only after weight changes
        that bump no version counter: writes through ``.data``, e.g. peft's ``merge_adapter``)."""
        if self.prefix_pool is not None:
            self.prefix_pool.clear()
        packed_linear.clear(self.model)

    # ------------------------------------------------------------------ helpers
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _autocast(self, device: torch.device):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def _swap_attention(self, device: torch.device) -> str | None:
        """Switch an SDPA model to `cpu_attention.engine_sdpa` for a CPU call; returns the name to restore."""
        cfg = getattr(self.model, "config", None)
        if (device.type != "cpu" or cfg is None
                or getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "sub_configs", None)
                or not cpu_attention.register()):
            return None
        cfg._attn_implementation = cpu_attention.NAME
        return "sdpa"

    def _packed(self, device: torch.device):
        """A context running the model's linears on packed weights (`packed_linear`), yielding the cache,
        or a null context yielding None where packing is off or unavailable."""
        if not (self._packed_weights and packed_linear.available(self.compute_dtype, device)):
            return nullcontext(None)
        return packed_linear.cache_for(self.model, self.compute_dtype, self.max_batch_size).installed(self.model)

    def _lowp_weights(self) -> dict | None:
        """Low-precision copies of every float32 ``nn.Linear`` weight/bias, keyed by parameter name.

        autocast would cast these on every forward: its weight cache is off under ``inference_mode`` (and
        never covers frozen weights such as a LoRA base), which makes bf16 decode slower than float32. So
        they are cast once per ``generate`` call (from the current weights) and swapped in with
        ``torch.func.functional_call``. Embeddings and norms stay as they are (as under autocast); a tied
        ``lm_head`` gets its own copy. None for float32 compute.
        """
        if self.compute_dtype == torch.float32:
            return None
        cast: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for mname, mod in self.model.named_modules(remove_duplicate=False):
            if not isinstance(mod, torch.nn.Linear):
                continue
            for pname in ("weight", "bias"):
                p = getattr(mod, pname, None)
                if p is None or p.dtype != torch.float32:
                    continue
                if id(p) not in cast:
                    cast[id(p)] = p.detach().to(self.compute_dtype)
                out[f"{mname}.{pname}" if mname else pname] = cast[id(p)]
        return out

    def _forward(self, input_ids, attention_mask, position_ids, cache, weights) -> torch.Tensor:
        """One forward; returns the last position's logits as float32, shape (B, V)."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "use_cache": True, self._cache_kw: cache}
        if self._logits_kw is not None:
            kwargs[self._logits_kw] = 1
        if weights:
            out = torch.func.functional_call(self.model, weights, (), kwargs, tie_weights=False, strict=False)
        else:
            out = self.model(**kwargs)
        return out.logits[:, -1, :].float()

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> list[int]:
        """Raises ValueError for what `generate` refuses (its docstring); returns each prompt's budget."""
        if params.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {params.n}")
        budgets = prompt_budgets(params, len(prompts))
        if params.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
        check_prompt_seeds(params, len(prompts))
        check_constraints(params, len(prompts))
        cfg = getattr(self.model, "config", None)
        max_pos = getattr(cfg, "max_position_embeddings", None)
        vocab = self.model.get_input_embeddings().weight.shape[0]  # a peft LoRA embedding has no num_embeddings
        for i, (p, budget) in enumerate(zip(prompts, budgets)):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token id")
            if max_pos is not None and budget >= max_pos:
                raise ValueError(f"prompt {i}: its budget of {budget} new tokens leaves no room for a prompt "
                                 f"(max_position_embeddings={max_pos})")
            if max_pos is not None and len(p) > max_pos - budget:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with a budget of {budget} new tokens it must "
                    f"be at most {max_pos - budget} (max_position_embeddings={max_pos})")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= vocab:
                raise ValueError(f"prompt {i} holds token id {lo if lo < 0 else hi} outside [0, {vocab})")
        return budgets

    def _plan(self, prompts: list[list[int]], n: int, live: list[int]) -> list[tuple[list[int], list[list[int]]]]:
        """Work units: (prompt indices to prefill together, decode chunks of sample indices (n ways each)).

        Each decode chunk is a list of rows; row r = (prefill row p, sample j) flattened as p * n + j.
        Only the prompts of `live` (indices) are planned. Prompts are sorted by length so that prefill
        groups waste little padding.
        """
        order = sorted(live, key=lambda i: len(prompts[i]))
        if n >= self.max_batch_size:
            units = []
            for i in order:
                rows = list(range(n))
                chunks = [rows[k:k + self.max_batch_size] for k in range(0, n, self.max_batch_size)]
                units.append(([i], chunks))
            return units
        per = max(1, self.max_batch_size // n)
        return [(order[k:k + per], [list(range(len(order[k:k + per]) * n))])
                for k in range(0, len(order), per)]

    # ------------------------------------------------------------------ public
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt.

        Args:
            prompts: B prompts, each a non-empty list of token ids (no padding), in [0, vocab).
            params: sampling settings. temperature 0 is greedy; otherwise tokens are drawn from
                softmax(logits / temperature), restricted to the top-p nucleus when top_p < 1. With
                ``params.seed`` set, the result is a deterministic function of (seed, prompts, params, weights)
                and does not depend on ``max_batch_size``; without it, the seed is drawn from torch's global RNG.
                With ``params.prompt_seeds``, prompt i's samples are those of prompt ``index`` of a call seeded
                ``seed`` (its pair), so they do not depend on the other prompts of the call either.
        Returns:
            B lists (input order) of ``params.n`` Completions. ``token_ids`` has length C <= max_new_tokens
            and ends with the stop token when ``finish_reason == "stop"`` (a token of
            ``params.stop_token_ids`` or the tokenizer's eos); "length" means max_new_tokens was reached.
            ``logprobs[i]`` is log softmax(logits / T)[token_ids[i]] in nats (T = 1 when greedy), computed in
            float32 over the full, unfiltered vocabulary. With ``params.prompt_max_new_tokens``, prompt i's
            budget replaces max_new_tokens for its samples.
        Raises:
            ValueError: an empty prompt, a prompt longer than max_position_embeddings - its budget, a token
                id outside the vocabulary, or invalid params (n < 1, max_new_tokens < 0, a
                prompt_max_new_tokens that is not one int >= 0 per prompt, temperature < 0, top_p outside
                (0, 1]).
        """
        budgets = self._validate(prompts, params)
        t0 = time.perf_counter()
        n = params.n
        results: list[list[Completion | None]] = [[None] * n for _ in prompts]
        for i in range(len(prompts)):
            if budgets[i] == 0:
                results[i] = [Completion([], [], "length") for _ in range(n)]
        live = [i for i in range(len(prompts)) if budgets[i] > 0]
        if not live:
            return results  # type: ignore[return-value]

        stop = {int(t) for t in params.stop_token_ids}
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            stop.add(eos)
        elif eos is not None:
            stop.update(int(t) for t in eos)
        if params.ignore_eos:
            stop = set()
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())

        model = self.model
        was_training = model.training
        device = self._device()
        model.eval()
        restore_attn = self._swap_attention(device)
        # Per-role policy: this call generates with its role's LoRA adapter (weights are cast below,
        # after the switch, so the low-precision copies include it); the previous one comes back after.
        adapter, prev_adapter = role_adapter(model, params.role), getattr(model, "active_adapter", None)
        try:
            if adapter is not None and adapter != prev_adapter:
                model.set_adapter(adapter)
            torch.clear_autocast_cache()  # never reuse bf16 casts of weights updated since an earlier call
            if self.prefix_pool is not None:
                self.prefix_pool.validate(weights_fingerprint(model, self.compute_dtype))
            with torch.inference_mode(), self._autocast(device), self._packed(device) as packed:
                weights = None if packed is not None else self._lowp_weights()
                attn_dt = self.compute_dtype if device.type != "cpu" or packed is not None else torch.float32
                for group, chunks in self._plan(prompts, n, live):
                    self._run_unit(prompts, group, chunks, n, params, budgets, stop, base_seed, device, weights,
                                   results, attn_dt)
                del weights
        finally:
            torch.clear_autocast_cache()
            if restore_attn is not None:
                model.config._attn_implementation = restore_attn
            if adapter is not None and adapter != prev_adapter:
                model.set_adapter(prev_adapter)
            model.train(was_training)
            self.stats["seconds"] += time.perf_counter() - t0
            self.stats["calls"] += 1
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ the loop
    def _run_unit(self, prompts, group, chunks, n, params, budgets, stop, base_seed, device, weights, results,
                  attn_dt: torch.dtype) -> None:
        """Prefill `group` once (`_prefill_unpadded`, else `_prefill_padded`), then decode each chunk of
        rows from that cache (shared-prefix attention in `attn_dt`)."""
        lens = torch.tensor([len(prompts[i]) for i in group])
        pool = self.prefix_pool
        hits = [pool.lookup(prompts[i]) for i in group] if pool is not None else [(0, None)] * len(group)
        reused = torch.tensor([m for m, _ in hits])
        new = [prompts[i][m:] for i, (m, _) in zip(group, hits)]  # the whole prompt on a miss
        shared = self._shared_prefix and shared_prefix.supports(self.model) and shared_prefix.register()
        unpadded = self._prefill_unpadded(new, device, weights, attn_dt if shared else None) \
            if self._unpadded and len(group) > 1 and int(reused.max()) == 0 else None
        logits, cache, mask = unpadded if unpadded is not None else self._prefill_padded(new, hits, device, weights)
        self.stats["prompt_tokens"] += int(lens.sum() - reused.sum())
        self.stats["cached_tokens"] += int(reused.sum())
        if pool is not None and not _full_attention(cache):
            self.prefix_pool = pool = None  # sliding-window / hybrid caches: no safe reuse, so none

        shared = shared and _full_attention(cache)
        root = common_prefix([prompts[i] for i in group]) if shared and len(group) > 1 else 0
        root = root if root >= _MIN_SHARED_ROOT else 0
        if shared:  # the chunks read the prompts' KV in attn_dt: cast it once, layer by layer, not per chunk
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.to(attn_dt), layer.values.to(attn_dt)
        for c, rows in enumerate(chunks):
            sel = torch.tensor([r // n for r in rows], device=device)  # prefill row of each decode row
            if shared:  # the prompts' KV once, read by every chunk; rows hold only their own tokens
                chunk_cache = shared_prefix.SharedPrefixCache(cache, mask, sel, max(budgets[group[r // n]] for r in rows),
                                                              attn_dt, root=root)
            else:
                chunk_cache = cache if c == len(chunks) - 1 else copy.deepcopy(cache)
                chunk_cache.batch_select_indices(sel)
            owners = [(group[r // n], r % n) for r in rows]
            self._decode(chunk_cache, logits.index_select(0, sel), mask.index_select(0, sel),
                         lens.to(device).index_select(0, sel), owners, [budgets[i] for i, _ in owners], params, stop,
                         base_seed, weights, results, prompts)
        del cache

    def _prefill_padded(self, new: list[list[int]], hits: list, device, weights):
        """Prefill the `new` tokens of a unit's prompts in one left-padded batch, after their reused
        prefixes (`hits`, from the prefix pool; position ids continue each prefix). Returns
        (last-position logits (G, V) float32, the batch `DynamicCache`, its (G, W) attention mask)."""
        from transformers import DynamicCache

        reused = torch.tensor([m for m, _ in hits])
        width = max(len(x) for x in new)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = 0 if pad is None else pad
        ids = torch.full((len(new), width), pad, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for r, x in enumerate(new):
            ids[r, width - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[r, width - len(x):] = 1
        pos = (mask.cumsum(-1) - 1).clamp_(min=0) + reused[:, None]
        if int(reused.max()) > 0:
            past, past_mask = padded_past(hits)
            cache = _cache_holding([(k.to(device), v.to(device)) for k, v in past], self.model.config)
            mask = torch.cat([past_mask, mask], dim=-1)
        else:
            cache = DynamicCache(config=self.model.config)
        ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
        return self._forward(ids, mask, pos, cache, weights), cache, mask

    def _prefill_unpadded(self, prompts: list[list[int]], device, weights, kv_dtype: torch.dtype | None = None):
        """Prefill each of G distinct `prompts` alone, then left-pad their KV into one decode batch.

        A padded prefill batch attends through an explicit (G, L, L) mask over the longest prompt's
        width (no causal fast path) and computes the padding too: measured on 2 AVX2 cores, float32,
        SmolLM2-135M, 8 prompts of 1.3k-2.1k tokens, 87 s padded vs 45 s one by one. Each row's KV
        equals re-encoding that prompt alone. Returns (last-position logits (G, V) float32, the batch
        `DynamicCache` (G, H_kv, W, D) with W = the longest prompt, its (G, W) attention mask), or
        None when the model's cache is not all full-attention layers (`_full_attention`: sliding-window
        or hybrid caches cannot be padded this way), in which case the caller prefills padded, and so
        does every later call (found out on the first prompt, so one forward is spent once). `kv_dtype`:
        each row's KV is cast to it as soon as the row is prefilled (the dtype shared-prefix decode reads
        it in), so the rows and their padded batch are never all held in float32 (None: kept as computed)."""
        from types import SimpleNamespace

        from transformers import DynamicCache

        rows, entries = [], []
        for x in prompts:
            one = DynamicCache(config=self.model.config)
            ids = torch.tensor([x], dtype=torch.long, device=device)
            pos = torch.arange(len(x), device=device)[None]
            rows.append(self._forward(ids, torch.ones_like(ids), pos, one, weights))
            if not _full_attention(one):
                self._unpadded = False
                return None
            kv = [(layer.keys[0], layer.values[0]) for layer in one.layers]
            if kv_dtype is not None:
                kv = [(k.to(kv_dtype), v.to(kv_dtype)) for k, v in kv]
            entries.append((len(x), SimpleNamespace(kv=kv)))
            del one
        past, mask = padded_past(entries)
        return torch.cat(rows), _cache_holding(past, self.model.config), mask.to(device)

    def _decode(self, cache, logits, mask, next_pos, owners, limits, params, stop, base_seed, weights, results,
                prompts) -> None:
        """Decode rows until each emits a stop token or reaches its token budget.

        cache: KV cache with S rows; logits: (S, V) float32 for the next token; mask: (S, L) attention mask;
        next_pos: (S,) position id of the next token; owners: S (prompt index, sample index) pairs;
        limits: S token budgets (each >= 1). Finished rows are dropped from the batch.
        """
        device = logits.device
        greedy = params.temperature == 0
        temp = 1.0 if greedy else float(params.temperature)
        gens = None
        if not greedy:
            gens = []
            seeds = params.prompt_seeds
            for i, j in owners:
                g = torch.Generator(device=device)
                g.manual_seed(_row_seed(*(seeds[i] if seeds is not None else (base_seed, i)), j))
                gens.append(g)
        cons = params.constraints if params.constraints is not None and \
            any(c is not None for c in params.constraints) else None
        toks: list[list[int]] = [[] for _ in owners]
        lps: list[list[float]] = [[] for _ in owners]
        active = list(range(len(owners)))  # original row index of each current batch row
        fused = self._fused_decode and weights is None and isinstance(cache, shared_prefix.SharedPrefixCache) \
            and fused_decode.supports(self.model)

        for _ in range(max(limits)):
            scaled = logits if temp == 1.0 else logits / temp
            logp = torch.log_softmax(scaled, dim=-1)  # (S, V) float32
            if greedy:
                chosen = scaled.argmax(dim=-1)
            else:
                probs = logp.exp()
                if params.top_p < 1.0:
                    probs = _top_p_filter(probs, params.top_p)
                # inverse-CDF sampling, one uniform per row from that row's own generator
                cdf = probs.double().cumsum(dim=-1)
                u = torch.stack([torch.rand((), generator=gens[a], dtype=torch.float64, device=device)
                                 for a in active])
                chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
                chosen = chosen.clamp_(max=cdf.shape[-1] - 1)
            dead: set[int] = set()
            if cons is not None:  # with ignore_eos nothing is a stop: the constraint is asked ends=False
                chosen, gone, refused = constrain_step(chosen, None if greedy else probs, logp,
                                                       [cons[owners[a][0]] for a in active],
                                                       [toks[a] for a in active], stop,
                                                       None if greedy else [gens[a] for a in active])
                dead = set(gone)
                self.stats["constraint_refusals"] += refused
                self.stats["constraint_dead_rows"] += len(gone)
            chosen_lp = logp.gather(-1, chosen[:, None])[:, 0]
            chosen_l, chosen_lp_l = chosen.tolist(), chosen_lp.tolist()

            keep = []
            for b, a in enumerate(active):
                if b in dead:  # no token its constraint allows: it ends without one (its KV is all fed)
                    self._finish(results, owners[a], toks[a], lps[a], "stop")
                    self._keep_prefix(cache, b, mask[b], prompts[owners[a][0]] + toks[a])
                    continue
                toks[a].append(chosen_l[b])
                lps[a].append(float(chosen_lp_l[b]))
                last = len(toks[a]) == limits[a]
                hit = chosen_l[b] in stop or (
                    params.stop_when is not None and not params.ignore_eos and not last
                    and len(toks[a]) % params.stop_check_every == 0 and params.stop_when(toks[a]))
                if hit or last:
                    self._finish(results, owners[a], toks[a], lps[a], "stop" if hit else "length")
                    self._keep_prefix(cache, b, mask[b], prompts[owners[a][0]] + toks[a][:-1])
                else:
                    keep.append(b)
            if not keep:
                return
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=device)
                cache.batch_select_indices(idx)
                mask, next_pos, chosen = mask[idx], next_pos[idx], chosen[idx]
                active = [active[b] for b in keep]
            if fused:
                logits = fused_decode.step(self.model, chosen[:, None], next_pos[:, None], cache)
            elif isinstance(cache, shared_prefix.SharedPrefixCache):  # its attention masks the prompt padding
                with shared_prefix.active(self.model, cache):
                    logits = self._forward(chosen[:, None], None, next_pos[:, None], cache, weights)
            else:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
                logits = self._forward(chosen[:, None], mask, next_pos[:, None], cache, weights)
            next_pos = next_pos + 1

    def _keep_prefix(self, cache, row: int, row_mask: torch.Tensor, tokens: list[int]) -> None:
        """Store batch row `row`'s cache (padding dropped) as the KV of `tokens` in the prefix pool."""
        if self.prefix_pool is None:
            return
        if isinstance(cache, shared_prefix.SharedPrefixCache):
            kv = [layer.row_kv(row) for layer in cache.layers]
            if kv[0][0].shape[1] != len(tokens):  # defensive, as below
                return
            self.prefix_pool.add(tokens, kv)
            return
        keep = row_mask.bool()
        if int(keep.sum()) != len(tokens):  # defensive: never store a cache that does not match its tokens
            return
        kv = [(layer.keys[row][:, keep], layer.values[row][:, keep]) for layer in cache.layers]
        self.prefix_pool.add(tokens, kv)

    def _finish(self, results, owner, toks, lps, reason) -> None:
        i, j = owner
        results[i][j] = Completion(token_ids=list(toks), logprobs=list(lps), finish_reason=reason)
        self.stats["generated_tokens"] += len(toks)
