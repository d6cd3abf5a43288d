"""Per-token log-probs and entropy from the LM head, a bounded number of tokens at a time.

The GRPO loss needs, per completion token k with hidden state h_k [d], target id y_k and sampling
temperature τ_k, only the scalar

    logp_k = log softmax(z_k)[y_k] = z_k[y_k] - logsumexp(z_k),   z_k = (W h_k + b) / τ_k   [V]

(and, as a metric without gradient, the entropy H_k = -Σ_v p_k[v] log p_k[v], p_k = softmax(z_k)).
Materialising z for all B·T positions costs a [B, T, V] float32 tensor (V = 49152 for SmolLM2) plus
its gradient. Here the head runs on at most `chunk_tokens` completion tokens at a time, and only on
completion tokens (prompt and padding positions of the span are skipped).

Gradient (same formula autograd derives for `grpo.token_logprobs` over `head(h)`):
    ∂logp_k/∂z_k = onehot(y_k) - p_k,   ∂z_k/∂h_k = W / τ_k,   ∂z_k/∂(W, b) = (h_k, 1) / τ_k.
Because logp_k is a scalar, ∂logp_k/∂h_k = ((onehot(y_k) - p_k) / τ_k) W is a [d] vector that does
not depend on the upstream gradient: with a frozen head (LoRA elsewhere) it is computed in the forward
pass, chunk by chunk, and stored as a [K, d] tensor, so the backward is one multiply and the head costs
exactly the FLOPs of the full-logits path (2·K·d·V forward + 2·K·d·V for ∂/∂h). When the head's own
weight or bias needs a gradient, that gradient is Σ_k g_k (onehot(y_k) - p_k) ⊗ h_k / τ_k, a weighted
sum over tokens that needs the upstream g_k: the backward then recomputes each chunk's logits.
Peak memory of the head is a few [chunk_tokens, V] float32 tensors in either direction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_CHUNK_TOKENS", "chunked_token_logprobs"]

DEFAULT_CHUNK_TOKENS = 512  # [512, 49152] float32 = 96 MiB per live tensor


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of ceil(n / chunk) near-equal pieces of range(n), each <= chunk long. No short
    tail: on CPU a matmul over 1-3 rows gave ~3x the float32 error (against float64) of larger ones."""
    if n == 0:
        return []
    size = -(-n // -(-n // chunk))
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temp: torch.Tensor) -> torch.Tensor:
    """z = (h Wᵀ + b) / τ for one chunk: [c, V] float32 (the head's matmul in its weight's dtype, as
    `head(h).float()` computes it)."""
    return F.linear(h, weight, bias).float().div_(temp.unsqueeze(-1))


def _forward_chunks(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, temp: torch.Tensor, chunk: int, entropy: bool,
                    jacobian: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp [K], logsumexp [K] and entropy sum (0-d, nats) over K tokens, plus ∂logp/∂h [K, d] when
    `jacobian`. No autograd graph is built."""
    K = h.shape[0]
    lp = torch.empty(K, dtype=torch.float32, device=h.device)
    lse = torch.empty(K, dtype=torch.float32, device=h.device)
    ent = torch.zeros((), dtype=torch.float32, device=h.device)
    jac = torch.empty_like(h) if jacobian else None
    with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
        for s, e in _spans(K, chunk):
            z = _chunk_logits(h[s:e], weight, bias, temp[s:e])  # [c, V]
            tgt = targets[s:e].unsqueeze(-1)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            lp[s:e] = z.gather(-1, tgt).squeeze(-1) - lse[s:e]
            if not (entropy or jacobian):
                continue
            logp = z.sub_(lse[s:e].unsqueeze(-1))  # in place: z is not needed any more
            p = logp.exp()
            if entropy:
                ent += -(p * logp).sum()
            if jacobian:  # (onehot(y) - p) / τ, then @ W: [c, d]
                g = p.neg_().scatter_add_(-1, tgt, torch.ones_like(tgt, dtype=p.dtype))
                g.div_(temp[s:e].unsqueeze(-1))
                jac[s:e] = g.to(weight.dtype) @ weight
    return lp, lse, ent, jac


class _ChunkedLogprobs(torch.autograd.Function):
    """logp [K] (differentiable w.r.t. h, weight, bias) and entropy sum (not differentiable)."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temp, chunk, entropy):
        head_grad = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        jacobian = ctx.needs_input_grad[0] and not head_grad
        lp, lse, ent, jac = _forward_chunks(h, weight, bias, targets, temp, chunk, entropy, jacobian)
        ctx.chunk, ctx.recompute = chunk, head_grad
        if head_grad:
            ctx.save_for_backward(h, weight, bias, targets, temp, lse)
        else:
            ctx.save_for_backward(jac)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        if not ctx.recompute:
            (jac,) = ctx.saved_tensors
            return grad_lp.unsqueeze(-1).to(jac.dtype) * jac, None, None, None, None, None, None
        h, weight, bias, targets, temp, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        gb = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            for s, e in _spans(h.shape[0], ctx.chunk):
                z = _chunk_logits(h[s:e], weight, bias, temp[s:e])
                g = z.sub_(lse[s:e].unsqueeze(-1)).exp_().neg_()  # -p
                tgt = targets[s:e].unsqueeze(-1)
                g.scatter_add_(-1, tgt, torch.ones_like(tgt, dtype=g.dtype))  # onehot(y) - p
                g.mul_((grad_lp[s:e].float() / temp[s:e]).unsqueeze(-1))  # ∂L/∂(W h + b): [c, V]
                gw_ = g.to(weight.dtype)
                if need_h:
                    gh[s:e] = (gw_ @ weight).to(h.dtype)
                if need_w:
                    gw += (gw_.t() @ h[s:e].to(weight.dtype)).float()
                if need_b:
                    gb += g.sum(0)
        return (gh, gw.to(weight.dtype) if need_w else None, gb.to(bias.dtype) if need_b else None,
                None, None, None, None)


def chunked_token_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
                           temperature: torch.Tensor, mask: torch.Tensor,
                           chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                           entropy: bool = False) -> tuple[torch.Tensor, float]:
    """log softmax(head(hidden) / temperature)[target] at the masked positions, and their entropy sum,
    never holding more than `chunk_tokens` rows of logits.

    Equals ``grpo.token_logprobs(head(hidden).float(), targets, temperature)`` on `mask` (up to float
    rounding), with the same gradients w.r.t. `hidden` and the head's trainable parameters; the
    entropy equals ``Σ_masked -Σ_v p log p`` of those logits (the trainer's `_entropy_sum`).

    Args:
        hidden: [B, T, d] final hidden states (any float dtype; cast to the head's weight dtype, with
            grad) whose logits predict `targets`; only positions where `mask` is True are used.
        head: the LM head, a plain `torch.nn.Linear` (logits = hidden Wᵀ + b, nothing after it).
        targets: [B, T] int ids whose log-probs are wanted (ignored where `mask` is False).
        temperature: [B] per-row sampling temperature (> 0), or a float for all rows.
        mask: [B, T] bool, True on the tokens to score.
        chunk_tokens: at most this many tokens' logits ([chunk_tokens, V] float32) exist at a time,
            forward and backward.
        entropy: also compute the entropy sum (no gradient); 0.0 is returned otherwise.

    Returns:
        (logp, entropy_sum): logp [B, T] float32 natural-log probabilities, 0 where `mask` is False
        (differentiable w.r.t. `hidden` and the head's parameters when grad is enabled);
        entropy_sum a float in nats, summed over the masked tokens.

    Raises:
        TypeError: `head` is not a `torch.nn.Linear`.
        ValueError: `chunk_tokens` < 1, or `hidden`, `targets` and `mask` disagree on [B, T].
    """
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"head must be a torch.nn.Linear, got {type(head).__name__}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2] or mask.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [B, T, d] and targets, mask [B, T]; got {tuple(hidden.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(mask.shape)}")
    B, T = mask.shape
    mask = mask.bool()
    weight, bias = head.weight, head.bias
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device).reshape(-1, 1)
    temp = temp.expand(B, T)[mask]  # [K]
    h = hidden[mask].to(weight.dtype)  # [K, d]
    tgt = targets[mask].long()
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    if grad:
        lp, ent = _ChunkedLogprobs.apply(h, weight, bias, tgt, temp, chunk_tokens, entropy)
    else:
        lp, _, ent, _ = _forward_chunks(h, weight, bias, tgt, temp, chunk_tokens, entropy, False)
    out = torch.zeros((B, T), dtype=torch.float32, device=hidden.device).masked_scatter(mask, lp)
    return out, float(ent) if entropy else 0.0
