"""Speculative decoding inside continuous batching (docs/design/speculative-decoding.md): a request's proposed tokens
become extra query tokens of its row, one pass verifies them.

`config` validates vLLM's `speculative_config`; `speculator` decides who speculates with how many
proposals (the scheduler's `Proposer`); `ngram` proposes from the request's own tokens (prompt lookup);
`rejection` and `verification` decide which proposals a pass accepts, so outputs keep the target
model's distribution. What runs a model lives in the engine: the draft model's runner
(`engine.draft_runner`) beside the target's, and the bookkeeping of verified tokens
(`engine.output_processor`).
"""

from .config import SpeculativeConfig
from .ngram import NgramProposer
from .rejection import VerifyResult, verify
from .speculator import Speculator

__all__ = ["NgramProposer", "SpeculativeConfig", "Speculator", "VerifyResult", "verify"]
