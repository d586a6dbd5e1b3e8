"""Speculative decoding, the worker's side: a draft model loads with the target's
weights (before the KV pool is sized: its KV blocks of the same tokens count too) and
goes to the runner as its `draft_model` (spec_decode/model_runner.py)."""
from __future__ import annotations

import dataclasses
import logging

from ..features import Composition
from ..model.model_loader import load_model, weights_source
from ..worker.worker import Worker, weights_info

logger = logging.getLogger(__name__)


class SpecDecodeWorker(Worker):
    def _load_extra_models(self) -> dict:
        sc, config = self.config.speculative_config, self.config
        if sc.method != "draft_model":
            return super()._load_extra_models()
        # its weights' own format; a draft's activations stay exact
        draft_config = dataclasses.replace(config, quantization=sc.quantization, activation_quantization=None)
        draft = load_model(sc.model, config.torch_dtype, self.device, config.max_model_len, self.tp,
                           model_class=lambda family: Composition.of(draft_config).build(family, "model"))
        if self.rank == 0:
            logger.info("draft model loaded from %s (%d layers): %s", weights_source(sc.model),
                        draft.config.num_hidden_layers, weights_info(draft).describe())
        return {**super()._load_extra_models(), "draft_model": draft}
