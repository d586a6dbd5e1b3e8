"""Every error as OpenAI's JSON body {"error": {"message", "type", "param", "code"}}:
400 for a body pydantic refuses or bytes that are not JSON, the status an OpenAIError
carries, 500 for a bug (no traceback: Starlette logs it). vLLM: the exception handlers of
`vllm/entrypoints/openai/api_server.py`."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import OpenAIError, error_body
from .serving import ClientGone


async def _openai_error(_, e: OpenAIError):
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status)


async def _http_error(_, e: StarletteHTTPException):      # bytes that are not JSON, 404, 405
    return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code, headers=e.headers)


async def _bug(_, e: Exception):            # Starlette logs the traceback after this answer
    return JSONResponse(error_body(500, f"internal server error ({type(e).__name__})"), status_code=500)


async def _gone(_, e: ClientGone):
    return Response(status_code=499)          # nginx's "client closed request"; nobody reads it


async def _invalid(_, e: RequestValidationError):
    """400 naming each bad field's path, e.g. "messages.0.role: ..."."""
    errors = e.errors()
    bad_json = next((err for err in errors if err.get("type") == "json_invalid"), None)
    if bad_json is not None:
        reason = bad_json.get("ctx", {}).get("error", "")
        return JSONResponse(error_body(400, f"the body is not valid JSON: {reason}"), status_code=400)
    loc = [str(x) for x in errors[0].get("loc", ())[1:]] if errors else []
    message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ())[1:]) or 'body'}: {err.get('msg')}"
                        for err in errors)
    return JSONResponse(error_body(400, message, ".".join(loc) or None), status_code=400)


def add_exception_handlers(app: FastAPI) -> None:
    for kind, handler in ((OpenAIError, _openai_error), (StarletteHTTPException, _http_error),
                          (Exception, _bug), (ClientGone, _gone), (RequestValidationError, _invalid)):
        app.add_exception_handler(kind, handler)
