"""SpecDecodeEngineCore: the engine core with speculative decoding (chapter 19): it says
so at start, and adds the drafts' counts to get_stats (vLLM's spec_decode_* metrics).
The proposers are the runner's (spec_decode/), the draft slots and rollback the
scheduler's (spec_decode/scheduler.py). vLLM v1: `vllm/v1/spec_decode/metrics.py`.
"""
from __future__ import annotations

import logging

from ..engine.engine_core import EngineCore

logger = logging.getLogger(__name__)


class SpecDecodeEngineCore(EngineCore):
    """EngineCore that reports speculative decoding."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sc = self.config.speculative_config
        how = (f"n-gram lookup of {sc.prompt_lookup_min}..{sc.prompt_lookup_max} tokens" if sc.method == "ngram"
               else f"draft model {sc.model}")
        logger.info("speculative decoding: %d draft tokens a step, %s", sc.num_speculative_tokens, how)

    def get_stats(self) -> dict[str, int | float]:
        """EngineCore.get_stats plus the drafts (acceptance rate: accepted / drafted, 0..1)."""
        stats = self.scheduler.spec_decoding_stats
        return {**super().get_stats(),
                "spec_decode_num_drafts": stats.num_drafts,
                "spec_decode_num_draft_tokens": stats.num_draft_tokens,
                "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
                "spec_decode_acceptance_rate": stats.acceptance_rate}
