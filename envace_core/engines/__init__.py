"""Text generation engines behind one interface: token ids in, token ids + log-probs out."""

from envace_core.engines.base import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
