"""The ASGI middleware in front of every route: the API key (auth.py), the body's size
(413) and its JSON nesting depth (400). vLLM: the middlewares of
`vllm/entrypoints/openai/api_server.py`."""
from __future__ import annotations

import json

from ...utils.checks import check_json_nesting
from . import auth
from .protocol import error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20


async def send_error(send, status: int, message: str, code: str | None) -> None:
    """Answer with OpenAI's JSON error body, before the app has seen the request."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Checks the key, then reads the body (at most max_body_bytes, whatever the client
    declared: a chunked body is counted too) and counts its nesting before anything
    parses it (json.loads recurses once per level: 100,000 "[" would be a 500), then
    replays it to the app."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, browser_pages=()) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.browser_pages = browser_pages        # the server's features (auth.check_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None:
            refused = auth.check_key(scope, headers, self.api_key, self.browser_pages)  # a 401, or a page's 303
            if refused is not None:
                return await refused(scope, receive, send)
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await send_error(send, 413, f"request body is {int(declared)} bytes, more than "
                                               f"the server's limit of {self.max_body_bytes}",
                                    "request_too_large")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":          # disconnected while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return await send_error(send, 413, f"request body is more than the server's "
                                                   f"limit of {self.max_body_bytes} bytes",
                                        "request_too_large")
        try:
            check_json_nesting("the request body", b"".join(chunks))
        except ValueError as e:
            return await send_error(send, 400, str(e), None)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()                      # waits for http.disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)
