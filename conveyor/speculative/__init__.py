"""Speculative decoding inside continuous batching (SPEC section 11): a request's proposed tokens
become extra query tokens of its row, one pass verifies them.

`config` validates vLLM's `speculative_config`; `ngram` proposes from the request's own tokens
(prompt lookup); `rejection` verifies proposals so outputs keep the target model's distribution.
"""

from .config import SpeculativeConfig
from .ngram import NgramProposer
from .rejection import VerifyResult, verify
from .speculator import Speculator

__all__ = ["NgramProposer", "SpeculativeConfig", "Speculator", "VerifyResult", "verify"]
