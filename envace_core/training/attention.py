"""Grouped-query attention in training forwards without repeated key/value heads, on CPU.

SmolLM2-135M has 9 query heads over 3 key/value heads. transformers' SDPA path (``integrations.
sdpa_attention``) copies every key/value head ``num_key_value_groups`` times (``repeat_kv``) whenever an
attention mask is passed, since CUDA's fused kernels would otherwise fall back to the math kernel; with
grad, autograd saves those copies for the backward. The trainer's forwards over a padded batch or a
cached prefix pass a mask (a lone batch-1 prefix passes none, and transformers groups the heads there
itself), so every such layer saves [B, 9, P + T, d] keys and values where [B, 3, P + T, d] would do.
On CPU, torch's flash-attention kernel takes a mask and grouped heads together
(``scaled_dot_product_attention(..., enable_gqa=True)``, torch ≥ 2.5), and transformers has a switch
for it: the environment variable ``TRANSFORMERS_SDPA_FORCE_GQA=1``, read at every attention call.

Measured (2-core AVX2 CPU, float32, LoRA r=16 q/v; 12 rows of a 1.4k-token shared system prompt + 150
history + 60 completion tokens, 3 micro-batches of 4): the micro-batches' peak resident set fell from
3.09 to 2.18 GiB and the update took 48.4 s instead of 51.5 s; gradients equal the repeated-heads
path's up to float summation order (tests/test_trainer.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def grouped_kv_attention(device: torch.device) -> Iterator[bool]:
    """Within the block, transformers' SDPA attention passes grouped key/value heads to torch
    (``enable_gqa=True``) instead of repeating them; yields whether it does.

    Only on CPU: elsewhere (CUDA's kernels with a mask) grouped heads would take the math kernel. A
    value of ``TRANSFORMERS_SDPA_FORCE_GQA`` the user set is left as it is. Not for concurrent
    threads: the switch is process-wide for the block's duration.
    """
    if device.type != "cpu" or FORCE_GQA in os.environ:
        yield os.environ.get(FORCE_GQA) == "1"
        return
    os.environ[FORCE_GQA] = "1"
    try:
        yield True
    finally:
        os.environ.pop(FORCE_GQA, None)
