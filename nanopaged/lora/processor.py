"""Multi-LoRA, the input side: a request's adapter folder is read and checked here
(adapter.py), once per (lora_int_id, path), before the core does any work for it, and
the request goes on as a LoRAEngineCoreRequest (messages.py here). A bad folder is a
LoRAAdapterError (a ValueError) from add_request, and the engine serves on.
vLLM: `vllm/v1/engine/processor.py` (`_validate_lora`).
"""
from __future__ import annotations

import dataclasses

from ..engine.processor import Processor
from ..lora_request import LoRARequest
from ..messages import EngineCoreRequest
from ..sampling_params import BeamSearchParams
from .adapter import load_adapter
from .messages import LoRAEngineCoreRequest


class LoRAProcessor(Processor):
    """The Processor of an engine built with enable_lora.

    Attributes:
        lora_requests: lora_int_id -> the LoRARequest first seen with it (one id names one
            adapter: the same id with another name or path is refused).
    """

    @classmethod
    def from_config(cls, config, model_path, model_config) -> "LoRAProcessor":
        processor = super().from_config(config, model_path, model_config)
        processor.model_config, processor.max_lora_rank = model_config, config.lora_config.max_lora_rank
        processor.lora_requests = {}
        processor._checked = set()                   # (lora_int_id, path) of folders read and found good
        return processor

    def process_inputs(self, request_id: str, prompt, params, lora_request=None,
                       **kwargs) -> tuple[EngineCoreRequest, str | None]:
        """Processor.process_inputs; with an adapter, a LoRAEngineCoreRequest.

        Raises (besides the base's):
            ValueError: a BeamSearchParams with an adapter (not served).
        """
        if lora_request is not None and isinstance(params, BeamSearchParams):
            raise ValueError("beam search with a lora_request is not supported: run the adapter with "
                             "SamplingParams")
        request, text = super().process_inputs(request_id, prompt, params, lora_request=lora_request, **kwargs)
        if lora_request is None:
            return request, text
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
        return LoRAEngineCoreRequest(**fields, lora_request=lora_request), text

    def _check_lora_request(self, lora_request) -> None:
        """Raises:
            TypeError: not a LoRARequest.
            ValueError: its lora_int_id names another adapter; its folder cannot be
                served (LoRAAdapterError, naming the file and the field or tensor).
        """
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        known = self.lora_requests.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise ValueError(f"lora_int_id={lora_request.lora_int_id} already names adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}; {lora_request.lora_name!r} at {lora_request.lora_path!r} "
                             "needs an id of its own")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._checked:
            load_adapter(lora_request.lora_path, self.model_config, self.max_lora_rank)
            self._checked.add(key)
        self.lora_requests[lora_request.lora_int_id] = lora_request
