"""The server's API key (--api-key): who may in, and where the key must never appear.

    /v1/...                         `Authorization: Bearer KEY` (OpenAI's; vLLM's check)
    a feature's page ?key=KEY       once: a 303 redirect to the same URL without the key,
                                    that sets an HttpOnly cookie (the dashboard's page:
                                    /dashboard?key=KEY)
    its guarded paths               the header, or that cookie (the dashboard's page and
                                    its stream /dashboard/events)

A browser cannot put a header on the page it opens, nor on the EventSource the page opens
for its stream, so a browser page takes the key in the URL; but a URL is written to access
logs, browser history and proxies' logs. So the key is taken there once and traded for a
cookie that the browser then sends by itself (HttpOnly: the page's scripts cannot read
it; SameSite=Lax: another site's page cannot make the browser send it with a fetch or an
EventSource, only with a plain link that opens the page, which is read-only; Strict
would also hold it back on that link, landing a clicked link on a 401; Path: the
feature's, e.g. /dashboard, so no other path gets it). The cookie holds an HMAC of the
key, not the key: it opens that feature's paths and nothing else. And the access log is
filtered (`RedactSecrets`), so a key someone put in any URL, accepted or refused, is
logged as `key=REDACTED`.

A feature's browser pages are its attributes `cookie`, `cookie_path`, `key_pages` and
`guarded` (server_features.py; the dashboard's: dashboard/routes.py).

vLLM checks the header only (`vllm/entrypoints/openai/api_server.py`, its auth
middleware); the browser pages, their cookie and the filter are nanopaged's.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
from urllib.parse import parse_qsl, unquote_plus

from starlette.responses import JSONResponse, RedirectResponse, Response

from .protocol import error_body

# a query parameter whose value the access log never shows: key, api_key, api-key, token,
# access_token, ... (matched on the decoded name, so k%65y= is caught too)
_SECRET_NAME = re.compile(r"(?:.*[_-])?(?:key|token)", re.I)


def cookie_value(api_key: str, cookie: str) -> str:
    """The value of the cookie named `cookie`: HMAC-SHA256 of its name under the key
    (hex). It proves the key was given without being the key: a leaked cookie opens
    its feature's paths only, since each feature's cookie signs its own name."""
    return hmac.new(api_key.encode(), cookie.encode(), hashlib.sha256).hexdigest()


def _bearer_ok(headers: dict, api_key: str) -> bool:
    return hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + api_key.encode())


def _cookie_ok(headers: dict, api_key: str, cookie: str) -> bool:
    expected = cookie_value(api_key, cookie).encode()
    for part in headers.get(b"cookie", b"").split(b";"):
        name, _, value = part.strip().partition(b"=")
        if name == cookie.encode() and hmac.compare_digest(value, expected):
            return True
    return False


def _refused(message: str) -> Response:
    return JSONResponse(error_body(401, message, code="invalid_api_key"), status_code=401)


def check_key(scope, headers: dict, api_key: str, browser_pages=()) -> Response | None:
    """None if the request may go on; else the response to send instead: a 401 (OpenAI's
    error body, code "invalid_api_key"), or, for a right `?key=` on a feature's page,
    the 303 that sets the cookie and drops the key from the URL. Only /v1/ and the
    features' `guarded` paths are guarded (/health, /metrics and a page's static files
    are open).

    Args:
        scope: the ASGI scope (its path and raw query string are read).
        headers: the request's headers, lower-case bytes names -> bytes values.
        api_key: --api-key.
        browser_pages: the server's features (their cookie, cookie_path, key_pages,
            guarded are read).
    """
    path = scope["path"]
    if path.startswith("/v1/"):
        if _bearer_ok(headers, api_key):
            return None
        return _refused("Incorrect or missing API key (send 'Authorization: Bearer KEY')")
    owner = next((f for f in browser_pages if path in f.guarded), None)
    if owner is None:
        return None
    query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    given = [v for k, v in query if k == "key"]
    if given and path in owner.key_pages:
        if not all(hmac.compare_digest(v.encode(), api_key.encode()) for v in given):
            return _refused("Incorrect API key in ?key=")
        rest = "&".join(part for part in scope.get("query_string", b"").decode("latin-1").split("&")
                        if part and unquote_plus(part.partition("=")[0]) != "key")
        response = RedirectResponse(path + ("?" + rest if rest else ""), status_code=303)
        response.set_cookie(owner.cookie, cookie_value(api_key, owner.cookie), path=owner.cookie_path,
                            httponly=True, samesite="lax")
        return response
    if _bearer_ok(headers, api_key) or _cookie_ok(headers, api_key, owner.cookie):   # ?key= here: not looked at
        return None
    return _refused(f"Incorrect or missing API key (open the {owner.name} as {owner.key_pages[0]}?key=KEY, "
                    "which sets a cookie for its stream, or send 'Authorization: Bearer KEY')")


def redact_url(text: str) -> str:
    """`text` with the value of every secret-looking query parameter (key, api_key,
    token, ...) replaced by REDACTED: "/v1/models?key=K&a=1" -> "/v1/models?key=REDACTED&a=1".
    Text without a "?" comes back as it is."""
    path, sep, query = text.partition("?")
    if not sep:
        return text
    parts = [part.partition("=")[0] + "=REDACTED" if _SECRET_NAME.fullmatch(unquote_plus(part.partition("=")[0]))
             else part for part in query.split("&")]
    return path + sep + "&".join(parts)


class RedactSecrets(logging.Filter):
    """A filter for uvicorn's access logger ("uvicorn.access"), whose record's args are
    (client address, method, path with query, HTTP version, status): every str arg
    goes through redact_url. It changes the record, never drops it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_url(a) if isinstance(a, str) else a for a in record.args)
        return True


def redact_access_log() -> None:
    """Put RedactSecrets on uvicorn's access logger (after uvicorn.Config has set up its
    logging: dictConfig keeps a logger's filters, but add it last to be sure)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSecrets) for f in access.filters):
        access.addFilter(RedactSecrets())
