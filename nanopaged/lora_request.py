"""LoRARequest: which LoRA adapter a request runs with (vLLM's `vllm/lora/request.py`).

    llm = LLM(enable_lora=True)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql-lora"))

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors), named by
the caller's `lora_int_id`, which the engine uses as its key everywhere below the front
end: one id, one adapter. It crosses hosts inside the step's message (utils/codec.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .utils import codec
from .utils.checks import invalid, is_int


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter.

    Args:
        lora_name: what the caller calls it (a non-empty str; the server's model name).
        lora_int_id: its id, an int > 0, unique per adapter for the engine's life.
        lora_path: the adapter's local folder (a str or os.PathLike; kept as a str).

    Raises:
        ValueError: naming the field, for any bad value.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise invalid("lora_name", self.lora_name, "a non-empty str")
        if not is_int(self.lora_int_id) or self.lora_int_id < 1:
            raise invalid("lora_int_id", self.lora_int_id, "an int > 0")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not os.fspath(self.lora_path):
            raise invalid("lora_path", self.lora_path, "an adapter folder's path (a str or os.PathLike)")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))


codec.register(LoRARequest)
