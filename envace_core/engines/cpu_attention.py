"""The transformers engine's attention on CPU (`HFEngine` switches an SDPA model to it for its calls): decode in
float32, prefill with grouped key/value heads as they are. Registered with transformers' ``AttentionInterface``
under `NAME`."""

from __future__ import annotations

import torch

from envace_core.engines import shared_prefix

NAME = "envace_engine_sdpa"


def engine_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs):
    """transformers' SDPA as the engine runs it on CPU: decode in float32, prefill without copying KV heads.

    * One-token (decode) queries attend in float32: under autocast SDPA runs in bf16, and bf16 SDPA with a
      single query against a long KV cache is ~4-5x slower than float32 (no fast kernel), which made bf16
      decode slower than float32 decode.
    * Prefill (many queries) of a grouped-query model (``num_key_value_groups`` > 1) calls torch's SDPA with
      ``enable_gqa=True`` (torch >= 2.5), where transformers first copies every KV head ``groups`` times
      (``repeat_kv``; it enables GQA on CPU only without a mask). Same kernel, same arithmetic: the output is
      equal bit for bit. Measured on 2 cores (SmolLM2-135M, bf16, 250 new tokens after 2 000 reused ones):
      the prefill call 0.66-0.76 s -> 0.33-0.37 s.

    Shapes as in ``sdpa_attention_forward``: query (B, H, Q, D), key/value (B, H_kv, K, D), mask broadcastable
    to (B, H, Q, K) or None. Returns (output (B, Q, H, D) in query's dtype, None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == 1:
        with torch.autocast(query.device.type, enabled=False):
            out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                  dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        return out.to(query.dtype), weights
    groups = getattr(module, "num_key_value_groups", 1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    plain = (groups > 1 and SDPA_GQA and dropout == 0.0 and kwargs.get("position_bias") is None
             and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False)
             and (attention_mask is not None or (causal and query.shape[2] == key.shape[2])))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=attention_mask is None,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


# torch's SDPA takes grouped key/value heads itself from 2.5 on (``enable_gqa``).
SDPA_GQA = torch.__version__ >= (2, 5)


def register() -> bool:
    """Register `engine_sdpa` (and SDPA's mask builder) with transformers once; False if unsupported."""
    try:
        from transformers.masking_utils import sdpa_mask
    except ImportError:
        return False
    return shared_prefix.register_attention(NAME, engine_sdpa, sdpa_mask)
