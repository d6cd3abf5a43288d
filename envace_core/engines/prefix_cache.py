"""A bounded pool of per-sequence KV caches for `HFEngine`: multi-turn rollouts extend a cache instead of
re-encoding the whole history (the CPU analogue of vLLM's automatic prefix caching).

Every finished sample leaves one entry: its tokens (prompt + completion, minus the last sampled token, which
was never fed) and, per layer, its keys and values with padding removed. A later prompt reuses the entry
sharing its longest common token prefix (LCP), so only the new tokens (the inserted context, e.g. a tool
response, plus the chat markup of the next turn) are prefilled. Keying by token prefix means callers need
no handles: trajectory i's next turn finds trajectory i's previous turn, and the G trajectories of a group
all find the group's shared system prompt.

Entries are valid only for the weights that computed them: the pool is emptied whenever the fingerprint
(sum of the parameters' in-place version counters, the active adapter, the compute dtype) changes, e.g.
after an optimizer step. Weight changes that bypass in-place ops (``param.data = t``) are not seen: call
`PrefixPool.clear` (``HFEngine.reset_prefix_cache``) after those.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    """tokens: (L,) long; kv: one (keys, values) pair per layer, each (H_kv, L, D_head)."""

    tokens: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def weights_fingerprint(model, dtype: torch.dtype) -> tuple:
    """What KV entries depend on: parameter versions (bumped by every in-place update, incl. optimizers),
    the active adapter(s) and the compute dtype."""
    version = sum(p._version for p in model.parameters())
    return version, str(getattr(model, "active_adapter", None)), str(dtype)


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of the token sequences `seqs` (0 for none)."""
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for s in seqs[1:]:
        n = next((k for k in range(n) if s[k] != first[k]), n)
    return n


def _lcp(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D long tensors."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = (a[:m] != b[:m]).nonzero()
    return m if len(diff) == 0 else int(diff[0])


class PrefixPool:
    """LRU pool of `PrefixEntry`, bounded by the total number of cached tokens.

    Args:
        max_tokens: the most tokens held over all entries (memory ≈ max_tokens × layers × 2 × H_kv × D_head ×
            bytes per element, e.g. ≈ 23 KB/token for SmolLM2-135M in bf16). Must be > 0.
    Raises:
        ValueError: max_tokens < 1.
    """

    def __init__(self, max_tokens: int):
        if int(max_tokens) < 1:
            raise ValueError(f"prefix cache max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next = 0
        self._tokens = 0
        self._fingerprint: tuple | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def validate(self, fingerprint: tuple) -> None:
        """Empty the pool when the weights (or adapter, dtype) differ from those of its entries."""
        if fingerprint != self._fingerprint:
            self.clear()
            self._fingerprint = fingerprint

    def lookup(self, prompt: list[int]) -> tuple[int, PrefixEntry | None]:
        """(m, entry) with the longest common prefix m of `prompt` with an entry, capped at len(prompt) - 1
        so at least one prompt token is fed (its logits start the completion); (0, None) on a miss."""
        if not self._entries:
            return 0, None
        p = torch.tensor(prompt, dtype=torch.long)
        best, best_key = 0, None
        for key, e in self._entries.items():
            m = _lcp(p, e.tokens)
            if m > best:
                best, best_key = m, key
        best = min(best, len(prompt) - 1)
        if best_key is None or best <= 0:
            return 0, None
        self._entries.move_to_end(best_key)
        return best, self._entries[best_key]

    def add(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store one sequence's cache; entries it extends (strict prefixes) or equals are dropped."""
        n = len(tokens)
        if n == 0 or n > self.max_tokens:
            return
        t = torch.tensor(tokens, dtype=torch.long)
        for key in [k for k, e in self._entries.items() if len(e.tokens) <= n and _lcp(t, e.tokens) == len(e.tokens)]:
            self._tokens -= len(self._entries.pop(key).tokens)
        self._entries[self._next] = PrefixEntry(t, kv)
        self._next += 1
        self._tokens += n
        while self._tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old.tokens)


def padded_past(hits: list[tuple[int, PrefixEntry | None]]) -> tuple[list, torch.Tensor]:
    """Left-pad the reused prefixes of a prefill batch to one width.

    hits: B (m_r, entry) pairs (m_r = 0 for a miss). Returns (per-layer (keys, values) each
    (B, H_kv, W, D_head) with W = max m_r, row r's prefix right-aligned and zeros before it;
    attention mask (B, W) long, 1 on reused positions). Requires W > 0.
    """
    width = max(m for m, _ in hits)
    if len(hits) == 1:  # nothing to pad: views of the entry (a forward concatenates onto them, never writes)
        m, e = hits[0]
        return [(k[None, :, :m], v[None, :, :m]) for k, v in e.kv], torch.ones((1, m), dtype=torch.long)
    ref = next(e for m, e in hits if m > 0).kv
    mask = torch.zeros((len(hits), width), dtype=torch.long)
    layers = []
    for li, (k0, v0) in enumerate(ref):
        k = k0.new_zeros((len(hits), k0.shape[0], width, k0.shape[2]))
        v = v0.new_zeros((len(hits), v0.shape[0], width, v0.shape[2]))
        for r, (m, e) in enumerate(hits):
            if m > 0:
                k[r, :, width - m:] = e.kv[li][0][:, :m]
                v[r, :, width - m:] = e.kv[li][1][:, :m]
        layers.append((k, v))
    for r, (m, _) in enumerate(hits):
        if m > 0:
            mask[r, width - m:] = 1
    return layers, mask
