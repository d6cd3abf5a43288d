"""envace: World Rehearsal training and Private Rehearsal serving for LLM tool-use agents.

Importing the package makes the process offline by design: Hugging Face hub look-ups are disabled and
LiteLLM (imported by tau2) reads its bundled model-cost map instead of fetching it. These must be set
before `tau2` is first imported, so every entry point imports `envace_core` first.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DVC (data versioning) would otherwise send anonymous usage analytics over the network.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

__version__ = "0.1.0"


class EnvaceError(Exception):
    """Base class of every error envace raises on bad input; the message names the fix."""


class TransientError(EnvaceError):
    """A failure that may pass on retry (an S3 request that timed out or was throttled, an NCCL/
    rendezvous error): the Flyte task wrappers turn it into flytekit's recoverable exception, so the
    task's `retries` apply. Raise it only where nothing half-written is left behind."""
