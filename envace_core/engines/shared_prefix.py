"""Shared-prefix ("cascade") decode attention for `HFEngine`.

A GRPO group samples G completions of one prompt. The plain way (transformers' `DynamicCache` fanned out
G ways) holds G copies of the prompt's keys and values, re-concatenates all of them at every decode step
and attends over each copy: with a 1.5k-token prompt that copy traffic and attention cost G times the
prompt, and decoding G = 8 costs more than twice decoding G = 1.

Here the prompts' KV is kept once per prompt (``P`` rows) and each decode row ``s`` owns only the tokens
it generated (a buffer grown in place, no concatenation). One decode step of one layer computes, per row,

    softmax([q K_prefix[owner(s)]^T, q K_own(s)^T] * scale) [V_prefix[owner(s)]; V_own(s)]

with the padding of the prompt masked out: exactly the attention over the row's full sequence, only the
order of the sums differs. The prompts' part runs in the cache's dtype (float32, or bf16 where `HFEngine`
packs bf16 weights: half the bytes read per step); the rows' own tokens and the softmax in float32. The G
rows of one prompt attend to its prefix in one matmul that reads the prefix once (cascade attention, as in
FlashInfer / vLLM's cascade kernels; here in plain torch), and distinct prompts that begin with the same
tokens (a root: `root_split`) read the root's KV once in the same way.

With bf16 prompts on CPU, where each prompt's rows are consecutive (a group of one prompt, distinct prompts
one row each, P prompts x n samples), the parts go through torch's fused CPU attention kernel instead (the
flash-attention forward, which returns each query's log-sum-exp) and are merged by their log-sum-exps:
the same attention up to rounding, in fewer ops and one pass over each prompt's keys and values
(`SharedPrefixLayer.fused_route`; measured in benchmarks/RESULTS.md, "Decode attention through torch's fused
CPU kernel"). Float32 prompts keep the classic path, whose sums re-encoding in float32 reproduces.

Only models whose attention is plain scaled-dot-product softmax attention over every layer
(`supports` lists the model types) use it; others keep transformers' own path.
"""

from __future__ import annotations

import contextvars
from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

NAME = "envace_shared_prefix_decode"
# Decoder-only families whose every layer is full softmax attention with scale 1/sqrt(d) (optionally with
# q/k norms applied before the cache): no sliding window, softcapping, sinks or ALiBi.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})

_ACTIVE: contextvars.ContextVar["SharedPrefixCache | None"] = contextvars.ContextVar("envace_shared_prefix",
                                                                                       default=None)


def supports(model) -> bool:
    """True when `model` (a transformers causal LM, possibly peft-wrapped) can decode with this cache."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    # (HFEngine's CPU variant of SDPA counts as SDPA)
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager", "envace_engine_sdpa"):
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    types = getattr(cfg, "layer_types", None)
    return types is None or all(t == "full_attention" for t in types)


class SharedPrefixLayer(DynamicLayer):
    """One layer's decode KV: the prompts' keys/values once, each row's generated ones in its own buffer.

    Args:
        prefix_keys, prefix_values: (P, H_kv, L_p, D) of the P prompts (left-padded), as prefilled.
        prefix_mask: (P, L_p) bool, False on padding.
        owner: (S,) long, the prompt row of each decode row.
        capacity: initial room for generated tokens per row (grows by doubling).
        dtype: storage/compute dtype of the prompts' keys and values (float32, or bf16 with packed bf16
            weights on CPU). The rows' own keys and values are kept in float32 whatever `dtype`: they are
            few, and on a CPU a float32 product over them costs about a third of a bf16 one (whose fixed
            cost per call dominates at these sizes).
    """

    def __init__(self, prefix_keys, prefix_values, prefix_mask, owner, capacity: int, dtype: torch.dtype,
                 root: RootSplit | None = None):
        super().__init__()
        self.root_keys = self.root_values = None  # (1, H_kv, L_r, D): the prompts' common first tokens, once
        if root is not None:
            self.root_keys = prefix_keys[root.row:root.row + 1, :, root.lo:root.hi].to(dtype)
            self.root_values = prefix_values[root.row:root.row + 1, :, root.lo:root.hi].to(dtype)
            prefix_keys, prefix_values = prefix_keys[:, :, root.start:], prefix_values[:, :, root.start:]
            prefix_mask = root.suffix_mask
        self.prefix_keys = prefix_keys.to(dtype)
        self.prefix_values = prefix_values.to(dtype)
        self.prefix_mask = prefix_mask
        self.padded = not bool(prefix_mask.all())  # left padding to mask out in the scores
        self.owner = owner
        self._masked: torch.Tensor | None = None  # (S, 1, 1, L_p) True on each row's prompt padding
        self._diagonal: bool | None = None  # row i is prompt i's only row
        self._fused: tuple | None = None  # (route ok, additive prompt mask or None): `fused_route`, once per batch
        s, (_, h, _, d) = owner.numel(), prefix_keys.shape
        own_dtype = torch.promote_types(prefix_keys.dtype, torch.float32)
        self._k = prefix_keys.new_empty((s, h, max(capacity, 1), d), dtype=own_dtype)
        self._v = torch.empty_like(self._k)
        self.length = 0
        self.is_initialized, self.device = True, prefix_keys.device
        self.keys = self.values = None  # not a concatenated tensor: see own_keys / prefix_keys

    def update(self, key_states, value_states, *args, **kwargs):
        t = key_states.shape[-2]
        if self.length + t > self._k.shape[2]:
            grow = max(self._k.shape[2], t)
            self._k = torch.cat([self._k, self._k.new_empty(self._k.shape[:2] + (grow,) + self._k.shape[3:])], 2)
            self._v = torch.cat([self._v, self._v.new_empty(self._v.shape[:2] + (grow,) + self._v.shape[3:])], 2)
        self._k[:, :, self.length:self.length + t] = key_states
        self._v[:, :, self.length:self.length + t] = value_states
        self.length += t
        return self.own_keys, self.own_values

    @property
    def own_keys(self) -> torch.Tensor:
        """(S, H_kv, T, D): the keys of the tokens each row generated so far (float32)."""
        return self._k[:, :, :self.length]

    @property
    def own_values(self) -> torch.Tensor:
        return self._v[:, :, :self.length]

    def masked(self) -> torch.Tensor | None:
        """(S, 1, 1, L_p) bool, True on each row's prompt padding (None without padding); made once per batch."""
        if self.padded and self._masked is None:
            self._masked = ~self.prefix_mask.index_select(0, self.owner)[:, None, None, :]
        return self._masked if self.padded else None

    def one_row_per_prompt(self) -> bool:
        """Whether decode row i is prompt i's only row (8 distinct prompts, one sample each); once per batch."""
        if self._diagonal is None:
            s = self.owner.numel()
            self._diagonal = self.prefix_keys.shape[0] == s and bool(
                (self.owner == torch.arange(s, device=self.owner.device)).all())
        return self._diagonal

    def fused_route(self) -> tuple[bool, torch.Tensor | None]:
        """Whether `attend` takes torch's fused CPU attention kernel for this layer (`_attend_fused`: the root,
        prompt and own-token parts each through the kernel, merged by log-sum-exp), and the additive prompt
        mask it uses ((P, 1, 1, L_p) in the prompts' dtype, -inf on padding; None without padding). Only with
        `FUSED_ATTENTION` on (checked at every call), bf16 prompts on CPU (float32 keeps the classic path,
        whose sums re-encoding in float32 reproduces), the same number r >= 1 of rows per prompt in prompt
        order (a group of one prompt, distinct prompts one row each, P prompts x n samples as the engine lays
        them out), a non-empty prompt part and no prompt whose part is all padding (the kernel would return
        0 for it, not an empty softmax). The layout decision and the mask are made once per batch."""
        if self._fused is None:
            ok = (self.prefix_keys.dtype == torch.bfloat16 and self.prefix_keys.device.type == "cpu"
                  and self.prefix_keys.shape[2] > 0 and self._rows_in_prompt_order()
                  and bool(self.prefix_mask.any(-1).all()) and fused_kernel_available())
            mask = None
            if ok and self.padded:
                keep = self.prefix_mask[:, None, None, :]
                mask = torch.zeros(keep.shape, dtype=self.prefix_keys.dtype).masked_fill_(~keep, float("-inf"))
            self._fused = (ok, mask)
        return FUSED_ATTENTION and self._fused[0], self._fused[1]

    def _rows_in_prompt_order(self) -> bool:
        """Whether the S >= 1 decode rows are r = S / P rows per prompt in prompt order (owner 0 x r, 1 x r, ...)."""
        p, s = self.prefix_keys.shape[0], self.owner.numel()
        if s < p or s % p:
            return False
        order = torch.arange(p, device=self.owner.device).repeat_interleave(s // p)
        return bool(torch.equal(self.owner, order))

    def get_seq_length(self) -> int:
        root = 0 if self.root_keys is None else self.root_keys.shape[2]
        return root + self.prefix_keys.shape[2] + self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v, self.owner = self._k[indices], self._v[indices], self.owner[indices]
        self._masked = self._diagonal = self._fused = None

    def row_kv(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s full (keys, values), padding dropped, each (H_kv, L, D) in the dtype the prompts' keys
        and values are read in (``dtype``: float32, or bf16 with packed bf16 weights on CPU).

        The row's own tokens, kept in float32 while it decodes, are rounded to that dtype too, in half the memory:
        a later prefill of two or more tokens attends under bf16 autocast and a later decode holds its prompt in
        ``dtype``, so those read the same values as from a float32 copy. A later prefill of a single new token
        attends in float32 (as decode does, `cpu_attention.engine_sdpa`) and so reads these tokens rounded, where
        a float32 copy kept them unrounded: the same values that re-encoding the whole prompt reads (its
        prefill attends in bf16), not the same bits as before (~4e-3 in the logits, measured on a tiny model)."""
        p = int(self.owner[row])
        keep = self.prefix_mask[p]
        parts_k = [self.prefix_keys[p][:, keep], self.own_keys[row]]
        parts_v = [self.prefix_values[p][:, keep], self.own_values[row]]
        if self.root_keys is not None:
            parts_k.insert(0, self.root_keys[0])
            parts_v.insert(0, self.root_values[0])
        dtype = self.prefix_keys.dtype
        return torch.cat([t.to(dtype) for t in parts_k], 1), torch.cat([t.to(dtype) for t in parts_v], 1)


class RootSplit(NamedTuple):
    """Where P left-padded prompts' common first tokens (the root) sit in their prefill: row `row` holds
    them at columns [lo, hi); every column before `start` is padding or root in every row; `suffix_mask`
    (P, W - start) is True on each row's tokens after its root."""

    row: int
    lo: int
    hi: int
    start: int
    suffix_mask: torch.Tensor


def root_split(prefix_mask: torch.Tensor, root: int) -> RootSplit | None:
    """The `RootSplit` of prompts (their (P, W) bool mask) whose first `root` tokens are the same, or None
    when no row holds its root in consecutive columns (padding inside it) or `root` < 1.

    Raises:
        ValueError: a row of the mask has fewer than `root` tokens.
    """
    if root < 1:
        return None
    mask = prefix_mask.bool()
    count = mask.long().cumsum(-1)
    in_root = mask & (count <= root)
    if not bool((in_root.sum(-1) == root).all()):
        raise ValueError(f"a prompt has fewer than root={root} tokens")
    width = mask.shape[1]
    lo = in_root.int().argmax(-1)  # first root column per row
    hi = width - in_root.flip(-1).int().argmax(-1)  # one past the last
    whole = ((hi - lo) == root).nonzero()
    if whole.numel() == 0:
        return None
    row = int(whole[0, 0])
    start = int(hi.min())
    return RootSplit(row, int(lo[row]), int(hi[row]), start, (mask & (count > root))[:, start:])


class SharedPrefixCache(DynamicCache):
    """A transformers cache whose layers are `SharedPrefixLayer` (decode only; see the module docstring).

    Built from a prefilled `DynamicCache` of P prompt rows and its (P, L_p) attention mask; `owner` (S,)
    gives each decode row's prompt row. The prefill cache is only read, so one prefill serves any number
    of decode chunks. `root` > 0: the P prompts begin with the same `root` tokens (a GRPO group's
    trajectories after their first turn share the system prompt, tools and request); their keys and
    values are taken from one row and attended by every row in one product, and each row reads its own
    tokens after them only (`root_split`; not used when no row holds its root unpadded).
    """

    def __init__(self, prefill: DynamicCache, prefix_mask: torch.Tensor, owner: torch.Tensor, capacity: int,
                 dtype: torch.dtype = torch.float32, root: int = 0):
        super().__init__()
        keep = prefix_mask.bool()
        split = root_split(keep, root) if keep.shape[0] > 1 else None
        self.layers = [SharedPrefixLayer(layer.keys, layer.values, keep, owner, capacity, dtype, split)
                       for layer in prefill.layers]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)


def _grouped(q: torch.Tensor, keys: torch.Tensor, owner: torch.Tensor, diagonal: bool = False) -> torch.Tensor:
    """Scores of queries against their own prompt's prefix. q: (S, H_kv, g, D); keys: (P, H_kv, L, D);
    diagonal: row i is prompt i's only row (owner = arange(S), P = S). Returns (S, H_kv, g, L), a transposed
    view. Rows sharing a prompt use one matmul that reads its keys once.

    Each product is computed as ``K q^T`` (L x rows), not ``q K^T``: the keys are read in their stored
    row-major order, which on a CPU is 1.3x (8 prompts) to 5x (one prompt, one row) faster for these
    few-row products (measured on SmolLM2-135M's shapes, benchmarks/RESULTS.md, "Fused decode step")."""
    s, h, g, d = q.shape
    if keys.shape[0] == 1:  # one prompt (a GRPO group): all rows' queries in one matmul
        st = keys[0] @ q.transpose(0, 1).reshape(h, s * g, d).transpose(-1, -2)  # (H_kv, L, S*g)
        return st.view(h, -1, s, g).permute(2, 0, 3, 1)
    if diagonal:
        return (keys @ q.transpose(-1, -2)).transpose(-1, -2)
    out = q.new_empty((s, h, g, keys.shape[2]))
    for p in owner.unique().tolist():
        rows = (owner == p).nonzero()[:, 0]
        qp = q.index_select(0, rows).transpose(0, 1).reshape(h, rows.numel() * g, d)
        out[rows] = (keys[p] @ qp.transpose(-1, -2)).view(h, -1, rows.numel(), g).permute(2, 0, 3, 1)
    return out


def _grouped_out(probs: torch.Tensor, values: torch.Tensor, owner: torch.Tensor,
                 diagonal: bool = False) -> torch.Tensor:
    """probs (S, H_kv, g, L) @ each row's prompt values (P, H_kv, L, D) -> (S, H_kv, g, D); `diagonal` as in
    `_grouped`."""
    s, h, g, _ = probs.shape
    if values.shape[0] == 1:
        return (probs.transpose(0, 1).reshape(h, s * g, -1) @ values[0]).view(h, s, g, -1).transpose(0, 1)
    if diagonal:
        return probs @ values
    out = probs.new_empty((s, h, g, values.shape[-1]))
    for p in owner.unique().tolist():
        rows = (owner == p).nonzero()[:, 0]
        pp = probs.index_select(0, rows).transpose(0, 1).reshape(h, rows.numel() * g, -1)
        out[rows] = (pp @ values[p]).view(h, rows.numel(), g, -1).transpose(0, 1)
    return out


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function for one decode step over a `SharedPrefixCache`.

    query: (S, H, 1, D); key/value: (S, H_kv, T, D), the rows' own generated tokens (returned by
    `SharedPrefixLayer.update`); the prompts' KV comes from the active cache. Returns (output (S, 1, H, D)
    in query's dtype, None). `attention_mask` is ignored: the prompt padding mask is the cache's and
    generated tokens are never padded (rows decode in lockstep).
    """
    layer = _ACTIVE.get().layers[module.layer_idx]
    return attend(layer, query, key, value, module.scaling if scaling is None else scaling), None


def attend(layer: SharedPrefixLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scale: float) -> torch.Tensor:
    """One decode step's attention of `layer`'s rows (see the module docstring).

    query: (S, H, 1, D); key/value: (S, H_kv, T, D), the rows' own generated tokens (as
    `SharedPrefixLayer.update` returns them); scale: the score scale (1/sqrt(D) for the supported families).
    The prompt part runs in the layer's dtype, the rows' own part and the softmax in float32 (where
    `fused_route` holds, torch's fused kernel takes the parts and `_attend_fused` merges them).
    Returns (S, 1, H, D) in query's dtype.
    """
    s, heads, _, d = query.shape
    h_kv = key.shape[1]
    g = heads // h_kv
    dt = layer.prefix_keys.dtype
    with torch.autocast(query.device.type, enabled=False):
        q32 = query.float().contiguous().view(s, h_kv, g, d)  # one layout whatever the caller's: one rounding
        route, mask = layer.fused_route()
        if route and key.shape[2] > 0:  # (the kernel aborts the process on zero-length keys)
            out = _attend_fused(layer, q32, key, value, scale, mask)
            return out.reshape(s, heads, 1, d).transpose(1, 2).contiguous().to(query.dtype)
        q = q32.to(dt)
        parts = []
        if layer.root_keys is not None:  # the common root: one product for every row
            parts.append(_grouped(q, layer.root_keys, layer.owner))
        diagonal = layer.one_row_per_prompt()
        sp = _grouped(q, layer.prefix_keys, layer.owner, diagonal)  # (S, H_kv, g, L_p)
        so = q32 @ key.float().transpose(-1, -2)  # (S, H_kv, g, T)
        scores = torch.cat(parts + [sp, so], -1)  # float32, contiguous
        lr, lp = (parts[0].shape[-1] if parts else 0), sp.shape[-1]
        masked = layer.masked()
        if masked is not None:
            scores[..., lr:lr + lp].masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores.mul_(scale), dim=-1)
        out = _grouped_out(probs[..., lr:lr + lp].to(dt), layer.prefix_values, layer.owner, diagonal) \
            + probs[..., lr + lp:] @ value.float()
        if lr:
            out = out + _grouped_out(probs[..., :lr].to(dt), layer.root_values, layer.owner)
    return out.reshape(s, heads, 1, d).transpose(1, 2).contiguous().to(query.dtype)


def _fused_part(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One part of `_attend_fused` through the kernel: queries q (S, H_kv, g, D), contiguous, against keys and
    values (P, H_kv, L, D), L >= 1, with S = r * P rows in prompt order (rows [p r, (p + 1) r) read prompt p;
    S >= P >= 1): the r * g queries of one prompt go in one call that reads its keys once. mask: (P, 1, 1, L)
    additive in the keys' dtype, or None. Returns (output (S, H_kv, g, D) in the keys' dtype, log-sum-exp of
    each query's scaled scores (S, H_kv, g) float32)."""
    s, h, g, d = q.shape
    p = keys.shape[0]
    r = s // p
    if r == 1 and GQA_ONE_ROW and grouped_kernel_available():
        # one query per prompt: the g query heads of a KV head as heads, not as g query positions (the kernel
        # maps query head i to KV head i // g itself); measured ~0.7x the time of the (P, H_kv, g, D) layout
        # for 8 prompts (RESULTS.md "Distinct prompts' decode")
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.reshape(s, h * g, 1, d).to(keys.dtype), keys, values, 0.0, False, attn_mask=mask, scale=scale)
        return out.view(s, h, g, d), lse.view(s, h, g)
    if r > 1:
        q = q.view(p, r, h, g, d).transpose(1, 2).reshape(p, h, r * g, d)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(keys.dtype), keys, values, 0.0, False, attn_mask=mask, scale=scale)
    if r > 1:
        return (out.reshape(p, h, r, g, d).transpose(1, 2).reshape(s, h, g, d),
                lse.reshape(p, h, r, g).transpose(1, 2).reshape(s, h, g))
    return out, lse


def _attend_fused(layer: SharedPrefixLayer, q32: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """`attend`'s result as (S, H_kv, g, D) float32 through torch's fused CPU attention kernel (the flash
    attention forward ``_scaled_dot_product_flash_attention_for_cpu``: scores, softmax and the weighted sum in
    one pass over the keys, with the log-sum-exp of each query's scores). The parts (the common root, the
    prompts, the rows' own tokens) are attended separately and merged by their log-sum-exps, as cascade /
    split-KV decoding does (FlashInfer's merge of attention states; Dao et al., FlashDecoding): with
    o_i, m_i = a part's softmax output and log-sum-exp, o = sum_i exp(m_i - M) o_i / sum_i exp(m_i - M). The
    same attention as the classic path up to rounding: the root's and the prompts' parts are read and returned
    in bf16 (as there), the rows' own part and the merge are float32. Shapes as in `attend` (q32: its query
    as (S, H_kv, g, D) float32; key/value: the rows' own tokens, T >= 1); mask: `fused_route`'s."""
    parts = []
    if layer.root_keys is not None:
        parts.append(_fused_part(q32, layer.root_keys, layer.root_values, scale, None))
    parts.append(_fused_part(q32, layer.prefix_keys, layer.prefix_values, scale, mask))
    parts.append(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q32, key.float(), value.float(), 0.0, False, scale=scale))
    if len(parts) == 2:  # o = o_a + sigmoid(m_b - m_a) (o_b - o_a)
        (oa, la), (ob, lb) = parts
        oa = oa.float()
        return oa + torch.sigmoid(lb - la).unsqueeze(-1) * (ob - oa)
    lse = torch.stack([m for _, m in parts])
    w = torch.softmax(lse, 0).unsqueeze(-1)
    return sum(o.float() * wi for (o, _), wi in zip(parts, w))


# Whether `attend` may use torch's fused CPU attention kernel for bf16 prompts (`SharedPrefixLayer.fused_route`,
# read at every call); False keeps the classic path everywhere (for A/B measurements).
FUSED_ATTENTION = True
_FUSED_PROBE: list[bool] = []
# Whether `_fused_part` passes one row per prompt as grouped query heads (False: as g query positions per KV
# head, the layout it uses for several rows per prompt; for A/B measurements).
GQA_ONE_ROW = True
_GQA_PROBE: list[bool] = []


def fused_kernel_available() -> bool:
    """Whether this torch has the fused CPU attention op and it gives the attention and its log-sum-exp on a
    bf16 probe with a padding mask (checked once per process, as `packed_linear` probes oneDNN)."""
    if not _FUSED_PROBE:
        _FUSED_PROBE.append(_probe_fused())
    return _FUSED_PROBE[0]


def grouped_kernel_available() -> bool:
    """Whether the fused CPU attention op takes fewer key/value heads than query heads (query head i reads
    key/value head i // g) and gives the same attention and log-sum-exp as repeating them; checked once."""
    if not _GQA_PROBE:
        _GQA_PROBE.append(fused_kernel_available() and _probe_grouped())
    return _GQA_PROBE[0]


def _probe_grouped() -> bool:
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 1, 8, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(2, 2, 5, 8, generator=g).to(torch.bfloat16) for _ in range(2))
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = op(q, k, v, 0.0, False, scale=0.5)[:2]
        want, want_lse = op(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 0.0, False, scale=0.5)[:2]
        return (out.shape == want.shape and lse.shape == want_lse.shape
                and bool(torch.allclose(out.float(), want.float(), atol=0.01))
                and bool(torch.allclose(lse.float(), want_lse.float(), atol=0.01)))
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False


def _probe_fused() -> bool:
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 2, n, 8, generator=g).to(torch.bfloat16) for n in (3, 5, 5))
        keep = torch.tensor([[True] * 5, [False, False, True, True, True]])[:, None, None, :]
        mask = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill_(~keep, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=0.5)
        scores = (q.float() @ k.float().transpose(-1, -2) * 0.5).masked_fill(~keep, float("-inf"))
        want = torch.softmax(scores, -1) @ v.float()
        return (out.shape == want.shape and lse.shape == want.shape[:-1]
                and bool(torch.allclose(out.float(), want, atol=0.03, rtol=0.03))
                and bool(torch.allclose(lse.float(), torch.logsumexp(scores, -1), atol=0.03, rtol=0.01)))
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False


def _no_mask(*args, **kwargs):
    return None


_REGISTERED: set[str] = set()


def register_attention(name: str, fn, mask_fn) -> bool:
    """Register attention function `fn` and mask builder `mask_fn` with transformers under `name`, once;
    False when this transformers has no attention interface."""
    if name not in _REGISTERED:
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface
        except ImportError:
            return False
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, mask_fn)
        _REGISTERED.add(name)
    return True


def register() -> bool:
    """Register the attention function (and a no-op mask builder) with transformers once."""
    return register_attention(NAME, shared_prefix_attention, _no_mask)


class active:
    """Context manager: decode forwards inside it attend through `cache` (sets the model's attention
    implementation to this module's and restores it on exit)."""

    def __init__(self, model, cache: SharedPrefixCache):
        self.model, self.cache = model, cache

    def __enter__(self):
        self._token = _ACTIVE.set(self.cache)
        self._restore = self.model.config._attn_implementation
        self.model.config._attn_implementation = NAME
        return self.cache

    def __exit__(self, *exc):
        self.model.config._attn_implementation = self._restore
        _ACTIVE.reset(self._token)
        return False
