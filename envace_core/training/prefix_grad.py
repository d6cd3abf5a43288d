"""Summed completion cross-entropy of rows that share a prompt prefix, with the prefix run once.

The warm start's ACT examples of one domain share a system message of ~1.7k tokens (policy + tools)
and differ in a few hundred tokens of history; run row by row, every row pays the whole prompt's
forward and backward, whose attention is quadratic in its length (measured on the 2-core AVX2 CPU,
float32: ~50 s per 2.5k-token ACT row against ~4 s per 0.8k-token REHEARSE row).

Here the common prefix of the rows (P₀ tokens) is run once into a KV cache (with grad, or without and
again with grad at the end when recomputed: `SharedRoot`). Each row's
suffix (prompt[P₀:] + completion) then runs on that cache, one row at a time, against *detached leaf
copies* of the prefix keys/values, so a row's backward stops at the cache and accumulates
∂loss/∂(K, V) there; after the last row, one backward pushes the summed cache gradients through the
prefix. Forward values and gradients equal the row-by-row computation's (up to float summation
order): Σ_rows ∂L_r/∂θ = Σ_rows (∂L_r/∂θ|suffix + ∂L_r/∂KV · ∂KV/∂θ), and the prefix graph is
traversed once with Σ_rows ∂L_r/∂KV. Memory: the prefix's activations plus one row's suffix; with
the prefix recomputed (`SharedRoot`), its keys/values plus one row's suffix, then the prefix's backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from envace_core.engines.prefix_cache import common_prefix


def _row_ce(backbone, head, cache_kw: str, ids: list[int], n_compl: int, cache, device) -> torch.Tensor:
    """Summed CE (nats) of the last `n_compl` ids of `ids` given what precedes them (and `cache`)."""
    x = torch.tensor([ids], device=device)
    kw = {cache_kw: cache, "use_cache": cache is not None}
    h = backbone(input_ids=x, **kw).last_hidden_state[0, -n_compl - 1:-1]  # [C, H]
    logits = head(h.to(head.weight.dtype)).float()  # [C, V], float32
    return torch.nn.functional.cross_entropy(logits, x[0, -n_compl:], reduction="sum")


def shared_prefix_ce_backward(backbone, head, cache_kw: str, rows: Sequence[tuple[list[int], list[int]]],
                              scale: float, device, bf16: bool = False, min_shared: int = 16,
                              recompute: bool = False) -> float:
    """Backward of ``scale · Σ_rows CE(completion | prompt)`` into the model's trainable weights;
    returns that scaled loss (a float).

    The common prefix is a `SharedRoot` over the rows (module docstring); with `recompute` its
    activations are not held while the rows run (its forward runs again, with grad, after them).

    Args:
        backbone, head: the causal LM's decoder (returns ``last_hidden_state``) and its LM head, with
            logits == head(backbone(x)) (`PolicyTrainer` checks this before calling).
        cache_kw: the backbone's keyword for the KV cache ("cache" or "past_key_values").
        rows: (prompt ids [P_r], completion ids [C_r ≥ 1]) per row.
        scale: multiplies every row's summed CE (e.g. 1 / total completion tokens: a token mean).
        bf16: run the backbone under bfloat16 autocast (the head stays float32).
        min_shared: a common prefix shorter than this is not run separately (rows run whole).
        recompute: as `SharedRoot`'s.
    """
    if not rows:
        return 0.0
    n = min(common_prefix([p for p, _ in rows]), min(len(p) for p, _ in rows) - 1)
    total = 0.0
    shared = len(rows) >= 2 and n >= min_shared
    root = SharedRoot(backbone, cache_kw, rows[0][0][:n], device, bf16, recompute) if shared else None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for p, c in rows:
            ids, cache = (p[n:] + c, root.cache()) if root is not None else (p + c, None)
            loss = _row_ce(backbone, head, cache_kw, ids, len(c), cache, device) * scale
            loss.backward()
            total += loss.item()
    if root is not None:
        root.backward()
    return total


MIN_ROOT_TOKENS = 128  # a shorter prefix shared across micro-batches is not worth holding its graph


def root_clusters(prompts: Sequence[Sequence[Sequence[int]]], min_root: int = MIN_ROOT_TOKENS) -> list[tuple[list[int], int]]:
    """Consecutive micro-batches that share a root prefix, for `SharedRoot`.

    Args:
        prompts: per micro-batch (in run order), its rows' prompt ids.
        min_root: the least root worth sharing, in tokens.
    Returns:
        [(micro-batch indices, root length)], covering every micro-batch once, in order. A root is the
        longest common prefix of all the cluster's prompts, at most every prompt's length − 1 (so each
        row keeps at least one prompt token after it); clusters of one micro-batch, or whose root would
        be shorter than `min_root`, get 0 (no root: that micro-batch's own shared prefix still runs once).
    """
    out: list[tuple[list[int], int]] = []
    first: Sequence[int] | None = None
    root = 0
    for k, rows in enumerate(prompts):
        if not rows:
            raise ValueError(f"micro-batch {k} has no row")
        bound = min(len(p) for p in rows) - 1
        if out and first is not None:
            r = min(root, bound, common_prefix([first, *rows]))
            if r >= min_root:
                out[-1][0].append(k)
                out[-1] = (out[-1][0], r)
                root = r
                continue
        first, root = rows[0], min(bound, common_prefix(list(rows)))
        out.append(([k], root))
    return [(ks, r if len(ks) > 1 and r >= min_root else 0) for ks, r in out]


def _active_dropout(module: torch.nn.Module) -> bool:
    """True when `module` in training mode would draw random numbers in its forward: a dropout layer
    with p > 0, or a config dropout rate > 0 (``attention_dropout``, ``resid_pdrop``, ...; transformers
    applies those functionally), so a second forward would not reproduce the first."""
    if not module.training:
        return False
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()):
        return True
    cfg = getattr(module, "config", None)
    rates = cfg.to_dict().items() if hasattr(cfg, "to_dict") else ()
    return any(("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0 for k, v in rates)


class SharedRoot:
    """A prompt prefix common to several micro-batches of one optimizer step, whose graph is built once.

    The technique of `shared_prefix_ce_backward`, across micro-batches instead of rows: the root's
    keys/values are computed once; every micro-batch runs on a fresh cache over float32 *detached leaf
    copies* of them (`cache`), so its backward stops there and accumulates ∂loss/∂(K, V) into the
    leaves; `backward` then pushes the summed gradient through the root once. Gradients equal the
    per-micro-batch computation's up to float summation order (same identity as the module docstring);
    the leaves accumulate in float32, so a bf16 root loses nothing to the sum.

    Memory: without `recompute`, the root's activations stay alive until `backward`, on top of every
    micro-batch's own (measured: +1.85 GiB for a 1.4k-token root, SmolLM2-135M float32, LoRA q/v).
    With `recompute`, the root runs without grad here and again with grad in `backward`, after the
    micro-batches have freed theirs (activation recomputation as in `torch.utils.checkpoint`, at the
    cost of one more forward of R tokens); only the leaves (float32 copies of the R-token keys/values)
    and their gradients are held between. A backbone whose dropout is active (training mode, p > 0)
    keeps the graph instead: a second forward would draw other masks.

    Args:
        backbone, cache_kw: as `shared_prefix_ce_backward`.
        ids: the root's token ids (length R ≥ 1).
        device: where to run.
        bf16: run under bfloat16 autocast (as the micro-batches do).
        recompute: recompute the root's forward in `backward` instead of holding its graph.
    """

    def __init__(self, backbone, cache_kw: str, ids: Sequence[int], device, bf16: bool = False,
                 recompute: bool = False):
        self.length, self._config = len(ids), backbone.config
        self._args = (backbone, cache_kw, list(ids), device, bf16)
        self.recompute = recompute and not _active_dropout(backbone)
        with torch.no_grad() if self.recompute else contextlib.nullcontext():
            kv = self._forward()
        trainable = any(p.requires_grad for p in backbone.parameters())
        self._dtypes = [t.dtype for t in kv]
        self._leaves = [t.detach().float().requires_grad_(trainable if self.recompute else t.requires_grad)
                        for t in kv]
        self._kv = [] if self.recompute else kv

    def _forward(self) -> list[torch.Tensor]:
        """The root's keys and values, layer by layer ([K₀, V₀, K₁, V₁, ...], each [1, heads, R, d])."""
        backbone, cache_kw, ids, device, bf16 = self._args
        cache = DynamicCache(config=backbone.config)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            backbone(input_ids=torch.tensor([ids], device=device), use_cache=True, **{cache_kw: cache})
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]

    def cache(self) -> DynamicCache:
        """A fresh cache of the root (batch 1, R positions) over the leaves, in the root's dtype; the
        caller's forward appends to it (new tensors: the leaves are never written)."""
        kv = [leaf.to(dt) for leaf, dt in zip(self._leaves, self._dtypes)]
        return DynamicCache([(kv[2 * i], kv[2 * i + 1]) for i in range(len(kv) // 2)], config=self._config)

    def backward(self) -> None:
        """Backward of the summed leaf gradients through the root (once; the graph is freed). With
        `recompute`, the root's forward runs here first, with grad."""
        if self.recompute and any(leaf.grad is not None for leaf in self._leaves):
            with torch.enable_grad():
                self._kv = self._forward()
        pairs = [(t, leaf.grad.to(t.dtype)) for t, leaf in zip(self._kv, self._leaves)
                 if t.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self._kv, self._leaves = [], []
