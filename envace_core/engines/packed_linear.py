"""Linear layers on pre-packed bf16 weights for `HFEngine` on CPU (oneDNN).

torch's bf16 ``F.linear`` on CPU hands oneDNN a plain row-major weight on every call, and oneDNN reorders it
into its blocked layout each time. Reordering once and calling oneDNN's inner product on the packed weight
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the ops inductor's CPU weight
prepacking emits) computes the same products without that copy. Measured on 2 cores of an Intel Xeon with
AMX-BF16 over SmolLM2-135M's 210 body matrices: one pass at 1 row 20.0 -> 14.0 ms, at 1 500 rows (a prompt's
prefill) 293 -> 152 ms; the outputs were bit-identical to ``F.linear`` (benchmarks/RESULTS.md, "Packed bf16
weights").

`PackedLinears.installed(model)` swaps the ``forward`` of every ``nn.Linear`` with a float32 weight (a LoRA
base layer, its adapters, the LM head) for one on a packed bf16 copy and restores them on exit. Inputs are
cast to bf16, outputs are bf16, as under ``torch.autocast``. With ``frozen_only`` (the trainer's forward and
backward: `frozen_packed`) only frozen layers are swapped, and their backward gives the input its gradient
on a packed transpose. Packed copies are cached per module and rebuilt only when the weight or bias
changed (a new tensor, new storage, or a bumped ``_version``: every in-place update, e.g. an optimizer step,
bumps it); peft's LoRA adapter layers (``lora_A`` / ``lora_B``: small) are re-packed at every install where
they run on their own. A write through ``.data`` (or a fused optimizer step) bumps no version (peft's
``merge_adapter`` / ``unmerge_adapter`` write the base weights that way): call `PackedLinears.clear`
(``HFEngine.reset_prefix_cache``) after such a write to a frozen weight. One cache serves every engine on the
same model (`cache_for`).

For inference, a peft LoRA layer (``lora.Linear``: one active vanilla adapter, not merged, no dropout in
effect, no hooks) runs as one product on a packed copy of its merged weight ``W + scaling · B A`` (the
merge peft's ``merge_adapter`` computes, Hu et al. 2021 §4.1) instead of the base product plus the two
adapter products and peft's Python: at one token per row those cost about as much as the base product.
The merged copy is rebuilt when the base weight changes (its key, as above) or A or B differ in value from
those it was merged from (compared at every install: they are small, and a fused optimizer step changes them
without a version bump), so a policy updated once per iteration is merged once per iteration. It is rounded
to bf16 once as a whole: log-probs differ from the trainer's forward (bf16 base product plus the adapter's)
by rounding (0.002-0.004 nats per token on tiny test models).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext

import torch

_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROBE: dict[torch.dtype, bool] = {}


def available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether packed linears can run: bf16 compute on CPU, oneDNN with bf16 support in this torch build
    and CPU, and a probe inner product that equals ``F.linear`` (checked once per process)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    if dtype not in _PROBE:
        _PROBE[dtype] = _probe(dtype)
    return _PROBE[dtype]


def _probe(dtype: torch.dtype) -> bool:
    try:
        mkldnn = torch.ops.mkldnn
        if not (torch.backends.mkldnn.is_available() and mkldnn._is_mkldnn_bf16_supported()):
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g).to(dtype)
        x = torch.randn(2, 3, 16, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        got = mkldnn._linear_pointwise(x, mkldnn._reorder_linear_weight(w, 8), b, "none", [], "")
        want = torch.nn.functional.linear(x, w, b)
        return got.shape == want.shape and bool(torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _key(t: torch.Tensor | None):
    """What identifies a weight's current values: the tensor, its storage and its version counter. An
    inference tensor has no version counter, so its key never matches (re-packed on every install)."""
    if t is None:
        return None
    return (id(t), t.data_ptr(), object() if t.is_inference() else t._version)


class _Entry:
    __slots__ = ("_packed_t", "bias", "bkey", "factors", "hint", "module", "packed", "wkey")

    def __init__(self, module, wkey, bkey, packed, bias, hint, factors=None):
        self.module, self.wkey, self.bkey, self.packed, self.bias = weakref.ref(module), wkey, bkey, packed, bias
        self._packed_t, self.hint = None, hint
        self.factors = factors  # a merged LoRA copy: the (A, B) values it was merged from

    def packed_t(self) -> torch.Tensor:
        """The packed transpose (in_features x out_features rows), made on first use: dx = dy W."""
        if self._packed_t is None:
            w = self.module().weight.detach().to(self.packed.dtype).t().contiguous()
            self._packed_t = torch.ops.mkldnn._reorder_linear_weight(w, self.hint)
        return self._packed_t


class _FrozenPackedLinear(torch.autograd.Function):
    """y = x W^T + b on the packed W of a frozen layer; the backward gives only x a gradient,
    dx = dy W, on the packed W^T (the weight and bias get none)."""

    @staticmethod
    def forward(ctx, x, entry):
        ctx.entry, ctx.x_dtype = entry, x.dtype
        dtype = entry.packed.dtype
        return torch.ops.mkldnn._linear_pointwise(x if x.dtype == dtype else x.to(dtype), entry.packed, entry.bias,
                                                  "none", [], "")

    @staticmethod
    def backward(ctx, grad_y):
        e = ctx.entry
        gx = torch.ops.mkldnn._linear_pointwise(grad_y.to(e.packed.dtype).contiguous(), e.packed_t(), None,
                                                "none", [], "")
        return gx.to(ctx.x_dtype), None


class PackedLinears:
    """Packed bf16 copies of a model's float32 ``nn.Linear`` weights, rebuilt when a weight changes.

    Args:
        dtype: the compute dtype (bfloat16; see `available`).
        batch_hint: the row count oneDNN's blocked layout is chosen for (the decode batch); any row count
            runs on it.

    Attributes:
        stats: ``packed`` (modules packed, cumulative), ``reused`` (modules taken from the cache), ``bytes``
            (bytes held by the packed copies now, transposes included), ``merged`` (LoRA layers packed
            with their adapter merged in, cumulative; counted in ``packed`` too).
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, batch_hint: int = 8):
        self.dtype, self.batch_hint = dtype, int(batch_hint)
        self._entries: dict = {}  # id(module), or (id(LoRA layer), adapter) for a merged copy -> _Entry
        self.stats = {"packed": 0, "reused": 0, "bytes": 0, "merged": 0}

    def clear(self) -> None:
        """Drop every packed copy (the next install re-packs): after weights were written through ``.data``."""
        self._entries.clear()
        self.stats["bytes"] = 0

    def _entry(self, mod: torch.nn.Linear, always: bool = False) -> _Entry:
        wkey, bkey = _key(mod.weight), _key(mod.bias)
        e = self._entries.get(id(mod))
        if e is not None and not always and e.module() is mod and e.wkey == wkey and e.bkey == bkey:
            self.stats["reused"] += 1
            return e
        return self._pack(id(mod), mod, wkey, bkey, mod.weight.detach(), mod.bias)

    def _pack(self, slot, mod, wkey, bkey, weight: torch.Tensor, bias, factors=None) -> _Entry:
        """Pack `weight` (and cast `bias`) in `self.dtype` into a new entry for `mod` under `slot`."""
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype), self.batch_hint)
        bias = None if bias is None else bias.detach().to(self.dtype)
        e = self._entries[slot] = _Entry(mod, wkey, bkey, packed, bias, self.batch_hint, factors)
        self.stats["packed"] += 1
        return e

    def _merged_entry(self, mod, adapter: str) -> _Entry:
        """The packed copy of LoRA layer `mod`'s merged weight for `adapter` (cached like `_entry`)."""
        base = mod.base_layer
        a, b = mod.lora_A[adapter].weight.detach(), mod.lora_B[adapter].weight.detach()
        scaling = float(mod.scaling[adapter])
        wkey = (_key(base.weight), scaling)
        bkey = _key(base.bias)
        slot = (id(mod), adapter)  # one copy per adapter: a per-role policy switches adapters every call
        e = self._entries.get(slot)
        # the factors are compared by value (small): a fused optimizer step or a `.data` write changes them
        # without bumping their version counters
        if e is not None and e.module() is mod and e.wkey == wkey and e.bkey == bkey \
                and torch.equal(e.factors[0], a) and torch.equal(e.factors[1], b):
            self.stats["reused"] += 1
            return e
        self.stats["merged"] += 1
        return self._pack(slot, mod, wkey, bkey, base.weight.detach() + scaling * (b @ a), base.bias,
                          (a.clone(), b.clone()))

    def _prune(self) -> None:
        """Drop copies of modules that are gone, and merged copies of adapters the layer no longer has."""
        for k in [k for k, e in self._entries.items()
                  if e.module() is None or (isinstance(k, tuple) and k[1] not in e.module().lora_A)]:
            del self._entries[k]

    @contextmanager
    def installed(self, model: torch.nn.Module, frozen_only: bool = False, skip: tuple = ()):
        """Run every float32 ``nn.Linear`` of `model` on its packed copy inside the block (see the module
        docstring); the original forwards come back on exit, also on error. Weights must be on the CPU.

        frozen_only: for training forwards: only layers whose weight and bias need no gradient (a LoRA
        base) are swapped, and they pass gradients to their input (`_FrozenPackedLinear`);
        the trainable ones (the adapters) stay as they are, under the caller's autocast.
        skip: modules left as they are.

        Raises:
            RuntimeError: without ``frozen_only`` while autograd records (the packed inner product has no
                backward: run inside ``torch.inference_mode()`` or ``torch.no_grad()``).
        """
        if not frozen_only and torch.is_grad_enabled():
            raise RuntimeError("packed linears are for inference here: install them under torch.inference_mode() "
                               "or torch.no_grad(), or pass frozen_only=True for a training forward")
        self._prune()
        swapped = []
        dtype = self.dtype
        memo: list = [None, None]  # the last input cast and its cast: q/k/v (gate/up) share one input
        try:
            with torch.no_grad():
                merged = {} if frozen_only else {id(m): (m, a) for m in model.modules()
                                                 if (a := _mergeable_lora(m)) is not None}
                # a merged layer's base and factors (of every adapter) are not called: not packed here
                inside = {id(c) for m, _ in merged.values()
                          for c in (m.base_layer, *m.lora_A.values(), *m.lora_B.values())}
                for mod, adapter in merged.values():
                    e = self._merged_entry(mod, adapter)
                    swapped.append((mod, mod.__dict__.get("forward")))
                    mod.forward = _packed_forward(e.packed, e.bias, dtype, memo)
                for name, mod in model.named_modules():
                    if id(mod) in inside:
                        continue
                    if type(mod) is not torch.nn.Linear or mod.weight.dtype != torch.float32 \
                            or mod.weight.device.type != "cpu" or mod.weight.numel() == 0 \
                            or any(mod is m for m in skip):
                        continue
                    if frozen_only and any(p.requires_grad for p in mod.parameters(recurse=False)):
                        continue
                    e = self._entry(mod, always=".lora_" in f".{name}")
                    swapped.append((mod, mod.__dict__.get("forward")))
                    mod.forward = _frozen_forward(e) if frozen_only else _packed_forward(e.packed, e.bias, dtype, memo)
            self.stats["bytes"] = sum(t.numel() * t.element_size() for e in self._entries.values()
                                      for t in (e.packed, e._packed_t) if t is not None)
            yield self
        finally:
            memo.clear()
            for mod, prev in swapped:
                if prev is None:
                    del mod.forward
                else:
                    mod.forward = prev


def _mergeable_lora(mod) -> str | None:
    """The adapter name when `mod` is a peft LoRA ``Linear`` whose forward is exactly ``base(x) + scaling ·
    B(A(x))`` right now: one active vanilla adapter (no DoRA or other variant, no adapter bias), adapters
    enabled and not merged, dropout not in effect, float32 ``nn.Linear`` base and factors on the CPU, not
    ``fan_in_fan_out``, no hooks. None otherwise (peft's forward then runs as it is)."""
    if not (hasattr(mod, "base_layer") and hasattr(mod, "lora_A") and hasattr(mod, "lora_B")
            and type(mod).__module__.startswith("peft.tuners.lora") and type(mod).__name__ == "Linear"):
        return None
    if getattr(mod, "disable_adapters", True) or getattr(mod, "merged", True) or getattr(mod, "fan_in_fan_out", True):
        return None
    active = [a for a in mod.active_adapters if a in mod.lora_A]
    if len(active) != 1:
        return None
    a = active[0]
    if a in getattr(mod, "lora_variant", {}) or getattr(mod, "lora_bias", {}).get(a, False):
        return None
    base, la, lb, drop = mod.base_layer, mod.lora_A[a], mod.lora_B[a], mod.lora_dropout[a]
    if any(type(m) is not torch.nn.Linear or m.weight.dtype != torch.float32 or m.weight.device.type != "cpu"
           for m in (base, la, lb)) or la.bias is not None or lb.bias is not None:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (mod, base, la, lb, drop)):  # the merge skips them
        return None
    if drop.training and not isinstance(drop, torch.nn.Identity) and getattr(drop, "p", 0.0) > 0:
        return None
    return a


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, memo: list):
    """(..., in_features) -> (..., out_features) in `dtype`, on the packed weight. An input of another dtype
    is cast once: `memo` holds the last input object and its cast, and the layers that read the same
    input object next (a block's q/k/v or gate/up projections) reuse it. So an input must not be changed
    in place between two layers that read it, as none of the supported transformers families does."""
    op = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != dtype:
            if memo[0] is not x:
                memo[0], memo[1] = x, x.to(dtype)
            x = memo[1]
        return op(x, packed, bias, "none", [], "")

    return forward


def _frozen_forward(entry: _Entry):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _FrozenPackedLinear.apply(x, entry)

    return forward


def cache_for(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, batch_hint: int = 8) -> PackedLinears:
    """The `PackedLinears` shared by every engine on `model` (kept as long as the model lives)."""
    cache = _CACHES.get(model)
    if cache is None or cache.dtype != dtype:
        cache = _CACHES[model] = PackedLinears(dtype, batch_hint)
    return cache


def clear(model: torch.nn.Module) -> None:
    """Drop `model`'s packed copies, if it has any (`PackedLinears.clear`)."""
    cache = _CACHES.get(model)
    if cache is not None:
        cache.clear()


def frozen_packed(model: torch.nn.Module, bf16: bool, device: torch.device | str):
    """For a training forward + backward: `model`'s frozen linears on their packed copies (shared with
    the engines on `model`; `PackedLinears.installed(frozen_only=True)`) when `bf16` compute runs on a CPU
    where `available`; a null context otherwise. The LM head (``get_output_embeddings``) is left as it
    is: the trainer computes log-probs with it in float32."""
    if not (bf16 and available(torch.bfloat16, device)):
        return nullcontext()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return cache_for(model).installed(model, frozen_only=True, skip=(head,) if head is not None else ())
