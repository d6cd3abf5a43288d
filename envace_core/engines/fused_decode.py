"""One decode step of a Llama-family decoder as one Python loop over its layers, for `HFEngine`.

A decode step pushes one token per row through every layer. transformers' model forward does that through
several layers of Python per decoder layer (the model's mask and cache bookkeeping, keyword plumbing, output
dataclasses, ``apply_rotary_pos_emb`` twice), and at one token per row that Python, not the arithmetic, is a
large share of the step on a CPU. `step` computes the same forward with the model's own modules (norms,
projections, MLP, so LoRA adapters, biases and q/k norms apply as they are) and fewer tensor ops:

- queries and keys get their rotary position embedding in one pass (the two concatenated along the heads,
  ``x * cos + rotate_half(x) * sin`` as in transformers' ``apply_rotary_pos_emb``, with the sign of
  ``rotate_half`` folded into a copy of ``sin`` made once per step: the same products, bit for bit);
- the keys and values go straight into the `shared_prefix.SharedPrefixCache` layer and attention is
  `shared_prefix.shared_prefix_attention` (the function transformers would call through the attention
  interface);
- the residual stream and the MLP are the decoder layer's ``residual + f(norm(x))`` unchanged.

The result equals the transformers forward's last-position logits exactly in float32 (tests compare them
with ``torch.equal``); with packed bf16 linears it runs the same bf16 products.

Only for the families `supports` accepts: full softmax attention in every layer (as `shared_prefix`
requires), the Llama decoder layer (pre-norm attention, pre-norm MLP ``down(act(gate(x)) * up(x))``) and
rotary embeddings from ``model.model.rotary_emb``.
"""

from __future__ import annotations

import torch

from envace_core.engines import shared_prefix

# Decoder layers of these transformers families are Llama's (Qwen2 adds q/k/v biases, Qwen3 q/k norms
# before the rotary embedding): pre-norm attention + pre-norm gated MLP, rotary embeddings, no scaling of
# the embeddings or the logits.
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports(model) -> bool:
    """True when `model` (a transformers causal LM, possibly peft-wrapped) can decode through `step`."""
    if not shared_prefix.supports(model):
        return False
    lm = _causal_lm(model)
    cfg = getattr(lm, "config", None)
    if getattr(cfg, "model_type", None) not in FUSED_MODEL_TYPES:
        return False
    inner = getattr(lm, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")) \
            or not hasattr(lm, "lm_head"):
        return False
    need = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    attn_need = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")
    mlp_need = ("gate_proj", "up_proj", "down_proj", "act_fn")
    if not all(all(hasattr(layer, a) for a in need)
               and all(hasattr(layer.self_attn, a) for a in attn_need)
               and all(hasattr(layer.mlp, a) for a in mlp_need) for layer in inner.layers):
        return False
    # `step` replaces the forward of these modules: each must be transformers' own class (not a subclass
    # with its own forward) and carry no hooks, which `step` would skip
    bypassed = [inner] + [m for layer in inner.layers for m in (layer, layer.self_attn, layer.mlp)]
    return all(_plain(m) for m in bypassed)


def _plain(module) -> bool:
    """Whether `module` is a transformers model class without forward hooks or pre-hooks."""
    return type(module).__module__.startswith("transformers.models.") and not (
        module._forward_hooks or module._forward_pre_hooks)


def step(model, input_ids: torch.Tensor, position_ids: torch.Tensor,
         cache: shared_prefix.SharedPrefixCache) -> torch.Tensor:
    """One decode step: each row's next-token logits after appending `input_ids` to the cache.

    Args:
        model: a causal LM that `supports` accepts (peft-wrapped or not), in eval mode.
        input_ids: (S, 1) long, the token each decode row just emitted.
        position_ids: (S, 1) long, that token's position.
        cache: the rows' `shared_prefix.SharedPrefixCache` (S rows; each layer gets the new keys/values).

    Returns:
        (S, V) float32 logits.

    Raises:
        ValueError: a model without a Llama-family decoder (``model.model.layers``), `input_ids` not (S, 1)
            with S >= 1, `position_ids` neither (S, 1) nor (1, 1), or a cache with another layer count than
            the model or another row count than S (checked before the cache is touched).
    """
    lm = _causal_lm(model)
    inner = getattr(lm, "model", None)
    if not hasattr(inner, "layers"):
        raise ValueError(f"{type(lm).__name__} has no Llama-family decoder (model.model.layers); "
                         "check fused_decode.supports first")
    if input_ids.dim() != 2 or input_ids.shape[1] != 1 or input_ids.shape[0] < 1:
        raise ValueError(f"decode step takes (S, 1) input ids with S >= 1, got {tuple(input_ids.shape)}")
    s = input_ids.shape[0]
    if tuple(position_ids.shape) not in ((s, 1), (1, 1)):
        raise ValueError(f"position ids must be ({s}, 1) or (1, 1), got {tuple(position_ids.shape)}")
    if len(cache.layers) != len(inner.layers):
        raise ValueError(f"cache has {len(cache.layers)} layers, the model {len(inner.layers)}")
    if cache.layers[0].owner.numel() != s:
        raise ValueError(f"cache has {cache.layers[0].owner.numel()} decode rows, input ids {s}")
    x = inner.embed_tokens(input_ids)  # (S, 1, hidden)
    cos, sin = inner.rotary_emb(x, position_ids)  # (S, 1, D)
    half = cos.shape[-1] // 2
    # rotate_half(t) * sin == cat(t2, t1) * cat(-sin1, sin2): negation is exact, so the products are the same
    sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], -1)
    for layer, kv in zip(inner.layers, cache.layers):
        attn, mlp = layer.self_attn, layer.mlp
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(s, -1, attn.head_dim)
        k = attn.k_proj(h).view(s, -1, attn.head_dim)
        v = attn.v_proj(h).view(s, -1, 1, attn.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over the head dim before the rotary embedding
            q, k = attn.q_norm(q), attn.k_norm(k)
        heads = q.shape[1]
        qk = torch.cat([q, k], 1)  # (S, H + H_kv, D)
        qk = qk * cos + torch.cat([qk[..., half:], qk[..., :half]], -1) * sin_signed
        own_k, own_v = kv.update(qk[:, heads:, None], v)
        out = shared_prefix.attend(kv, qk[:, :heads, None], own_k, own_v, attn.scaling)
        x = x + attn.o_proj(out.reshape(s, 1, -1))
        h = layer.post_attention_layernorm(x)
        x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
    return lm.lm_head(inner.norm(x)[:, -1]).float()
