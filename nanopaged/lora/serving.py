"""Multi-LoRA in the OpenAI server: each adapter is a model with a name of its own, as
vLLM serves them (`vllm/entrypoints/openai/serving_models.py`, `api_server.py`).

    python -m nanopaged.serve --enable-lora --lora-modules sql=/adapters/sql \\
        '{"name": "french", "path": "/adapters/french"}' [--allow-runtime-lora-updating]

- A request's OpenAI `model` picks an adapter by its name; the base model's name (or
  none) picks the base model; any other name is the server's 404.
- GET /v1/models lists each adapter after the base model (id: its name, root: its
  folder, parent: the base model's name).
- With --allow-runtime-lora-updating (vLLM's environment variable
  VLLM_ALLOW_RUNTIME_LORA_UPDATING, a flag here as every other setting is):
  POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
  POST /v1/unload_lora_adapter {"lora_name"}, under /v1/ so that --api-key guards them
  (the flag without --api-key is refused at start: a load makes the server read a folder
  the client names); without the flag both are 404s.

A folder is checked (adapter.load_adapter) before its name is served: at the start, a
bad one stops the server (exit status 1, the error naming the file and the field, as
vLLM's init_static_loras refuses to start); on load, it is a 400 with that message and
the server serves on. Each name gets a fresh lora_int_id, never reused, so a name loaded
again after an unload is a new adapter to the engine (processor.py keys adapters by id).
The server finds this class through its table (entrypoints/openai/server_features.py)
and this module never imports the server: its errors are FastAPI's HTTPException.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from ..lora_request import LoRARequest
from .adapter import load_adapter

logger = logging.getLogger("nanopaged.entrypoints.openai.api_server")
router = APIRouter()


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules item: the adapter's model name and its folder (vLLM's)."""

    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModulePath:
    """An argparse type: `name=path`, or vLLM's JSON object {"name": ..., "path": ...}
    (its "base_model_name" is accepted and unused: the server has one base model).

    Raises:
        argparse.ArgumentTypeError: naming the item and what is wrong with it.
    """
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
        unknown = sorted(set(item) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown field {unknown[0]!r} (give name and path)")
        name, path = item.get("name"), item.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{text!r}: expected name=path or a JSON object "
                                             '{"name": ..., "path": ...}')
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise argparse.ArgumentTypeError(f"{text!r}: the name and the path must be non-empty strings")
    return LoRAModulePath(name, path)


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter's body (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter's body (vLLM's; its lora_int_id is not needed here)."""

    lora_name: str


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    """Serve a new adapter under `lora_name`: 200 with vLLM's line of text, or a 400
    naming the file and the field of a bad folder, or the name already served."""
    try:
        await request.app.state.lora_server.load(body.lora_name, body.lora_path)
    except ValueError as e:                          # LoRAAdapterError is one
        raise HTTPException(400, str(e)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    """Stop serving `lora_name` (LoRAServer.unload): 200, or a 404 for a name not served."""
    if not request.app.state.lora_server.unload(body.lora_name):
        raise HTTPException(404, f"The lora adapter '{body.lora_name}' cannot be found.")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


class LoRAServer:
    """LoRA adapters as models of `python -m nanopaged.serve` (the server's row "LoRA
    adapters"): turned on by the engine's --enable-lora, or by --lora-modules, which
    without --enable-lora is an error (vLLM's "LoRA is not enabled").

    Args:
        engine: the AsyncLLM served (its config's lora_config, its processor's
            model_config read).
        args: the parsed flags (enable_lora, lora_modules, allow_runtime_lora_updating).

    Raises:
        ValueError: --lora-modules without --enable-lora; --allow-runtime-lora-updating
            without --api-key; a name given twice; a folder
            the engine cannot serve (LoRAAdapterError: the file and the field).

    Attributes:
        lora_requests: model name -> its LoRARequest, in the order they were loaded.
    """
    name = "LoRA adapters"
    key_pages = guarded = ()                 # no browser pages

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--lora-modules", nargs="+", action="extend", type=parse_lora_module, default=[],
                            metavar="NAME=PATH", help="LoRA adapters served as models, with --enable-lora: "
                            'name=path or \'{"name": ..., "path": ...}\' each; a request\'s "model" picks one')
        parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                            help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING); needs --api-key: whoever holds the key can "
                                 "make the server read any folder it can see")

    @staticmethod
    def enabled(args: argparse.Namespace) -> bool:
        return bool(getattr(args, "enable_lora", False) or args.lora_modules)

    def __init__(self, engine, args: argparse.Namespace) -> None:
        if engine.config.lora_config is None:
            raise ValueError("--lora-modules needs --enable-lora: LoRA is not enabled in the engine")
        self.model_config = engine.processor.model_config
        self.max_lora_rank = engine.config.lora_config.max_lora_rank
        self.allow_updating = args.allow_runtime_lora_updating
        if self.allow_updating and not getattr(args, "api_key", None):
            # loading makes the server read a folder a client names: only a client with the key may
            raise ValueError("--allow-runtime-lora-updating needs --api-key: without a key, anyone who can reach "
                             "the server could make it read any folder it can see")
        self.base_name: str | None = None             # the base model's name, once mounted
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for module in args.lora_modules:
            self._add(self._checked(module.name, module.path))

    def _checked(self, name: str, path: str) -> LoRARequest:
        """The LoRARequest of a new adapter, its folder read and checked.

        Raises:
            ValueError: an empty name or path; a name already served; a bad folder
                (LoRAAdapterError).
        """
        if not name or not path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        self._check_name(name)
        load_adapter(path, self.model_config, self.max_lora_rank)
        return LoRARequest(name, next(self._ids), path)

    def _check_name(self, name: str) -> None:
        if name in self.lora_requests:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        if name == self.base_name:
            raise ValueError(f"'{name}' is the base model's name: an adapter needs a name of its own")

    def _add(self, lora: LoRARequest) -> None:
        self._check_name(lora.lora_name)
        self.lora_requests[lora.lora_name] = lora
        logger.info("LoRA adapter %r served as a model (lora_int_id %d, %s)", lora.lora_name, lora.lora_int_id,
                    lora.lora_path)

    async def load(self, name: str, path: str) -> LoRARequest:
        """Check the folder (in a thread: reading it must not stall the event loop), then
        serve it as `name`. Raises ValueError as _checked."""
        lora = await asyncio.to_thread(self._checked, name, path)
        self._add(lora)                       # again: another load of the name may have won meanwhile
        return lora

    def unload(self, name: str) -> bool:
        """Stop serving `name`; False when it is not served. Requests already running with
        it finish with it (each holds its LoRARequest, and the engine keeps the adapter
        while any uses it); new requests naming it get a 404."""
        lora = self.lora_requests.pop(name, None)
        if lora is not None:
            logger.info("LoRA adapter %r unloaded: new requests naming it get a 404", name)
        return lora is not None

    # -- the server's calls (server_features.py) -----------------------------------------

    def request_kwargs(self, model_name: str) -> dict | None:
        lora = self.lora_requests.get(model_name)
        return None if lora is None else {"lora_request": lora}

    def model_cards(self, base_name: str) -> list[dict]:
        return [{"id": lora.lora_name, "root": lora.lora_path, "parent": base_name}
                for lora in self.lora_requests.values()]

    def mount(self, app: FastAPI, model_name: str) -> None:
        """The load and unload routes (with --allow-runtime-lora-updating), and this
        object in `app.state.lora_server`, which they read.

        Raises:
            ValueError: an adapter named as the base model (the base would shadow it).
        """
        if model_name in self.lora_requests:
            raise ValueError(f"--lora-modules: '{model_name}' is the base model's name: an adapter needs a "
                             "name of its own")
        self.base_name = model_name
        app.state.lora_server = self
        if self.allow_updating:
            app.include_router(router)
            logger.warning("runtime LoRA updating is on (POST /v1/load_lora_adapter, /v1/unload_lora_adapter): "
                           "a client with the API key can make the server read folders on this machine")

    def ready_pages(self, url: str, api_key: str | None) -> list[str]:
        return []

    def close(self) -> None:
        """Nothing to end: the adapters' requests drain with the others."""
