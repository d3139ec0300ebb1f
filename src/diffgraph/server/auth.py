"""API keys: `--api-key KEY` (or DIFFGRAPH_API_KEY) makes every /v1/* route require `Authorization: Bearer KEY`;
HTTP Basic with the key as the password (any user name) is taken too, as AUTOMATIC1111 clients send it (webuiapi's
`set_auth`).

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would hide client disconnects from the
streaming handlers). It fails closed: every path needs a key except the open ones, /health, /ready, /info, the
playground page (/ and /playground/*), the API's documentation (/docs, its files and /openapi.json: the page is
public, the calls it makes carry the key its "Authorize" button takes), and /metrics and /status unless
`protect_metrics`; stored images
(/v1/images/files/*) check a signed URL or a key in their own route; paths are read as
the router sees them (without the app's root_path, so a mounted app is guarded the same). Keys are compared in
constant time (hmac.compare_digest, against every key) and never logged or echoed; `caller_key` says which key
a request carries (by index: the /sdapi/v1 routes keep per-key state). A refusal is a 401 in OpenAI's error shape
with `WWW-Authenticate: Bearer` (and Basic on /sdapi/ paths).
"""

from __future__ import annotations

import binascii
import hmac
import json
from typing import Any

OPEN_PATHS = ("/health", "/ready", "/info", "/", "/docs", "/openapi.json")
OPEN_PREFIXES = ("/playground/", "/docs/assets/")  # the playground's and the docs page's files
# stored images (`response_format: "url"`): the route itself requires a signed URL or a key (image_store.UrlSigner)
SELF_CHECKED_PREFIXES = ("/v1/images/files/",)
MONITORING_PATHS = ("/metrics", "/status")


def route_path(scope: dict[str, Any]) -> str:
    """The path as the router matches it: without the root_path a parent app or proxy put in front of it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def guarded(path: str, protect_metrics: bool = False) -> bool:
    """Whether a route path needs a key when the server has keys (the docs page's schema says so per operation)."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) or path.startswith(SELF_CHECKED_PREFIXES):
        return False
    return protect_metrics or path not in MONITORING_PATHS


def _credential(scope: dict[str, Any]) -> bytes:
    """The key a request carries: a Bearer token, or the password of HTTP Basic credentials; b"" without one."""
    header = b""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            header = value
            break
    scheme, _, token = header.partition(b" ")
    scheme, token = scheme.lower(), token.strip()
    if scheme == b"basic" and token:
        try:
            token = binascii.a2b_base64(token).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    elif scheme != b"bearer":
        return b""
    return token


def caller_key(scope: dict[str, Any], keys: tuple[bytes, ...]) -> int | None:
    """The index in `keys` of the key the request carries (Bearer, or Basic's password), compared in constant time
    against every key; None when it carries none of them."""
    token = _credential(scope)
    found = None
    for i, key in enumerate(keys):  # no early exit: the time does not tell which key, or whether any, matched
        if hmac.compare_digest(token, key) and token:
            found = i
    return found


def authorized(scope: dict[str, Any], keys: tuple[bytes, ...]) -> bool:
    """Whether the request carries one of `keys` (`Authorization: Bearer KEY`, or HTTP Basic with KEY as password)."""
    return caller_key(scope, keys) is not None


class APIKeyMiddleware:
    def __init__(self, app: Any, keys: tuple[str, ...], protect_metrics: bool = False):
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        self.protect_metrics = protect_metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or not guarded(route_path(scope), self.protect_metrics):
            await self.app(scope, receive, send)
            return
        if authorized(scope, self.keys):
            await self.app(scope, receive, send)
            return
        has_header = any(name == b"authorization" for name, _ in scope.get("headers", ()))
        sdapi = route_path(scope).startswith("/sdapi/")
        how = ("`Authorization: Bearer KEY`, or HTTP Basic with the key as the password (webuiapi: "
               "api.set_auth('user', KEY))" if sdapi else "`Authorization: Bearer KEY`")
        message = (f"the API key is not valid; send {how} with a key this server was started with" if has_header
                   else f"this server requires an API key: send {how}" + ("" if sdapi else
                                                                         " (the OpenAI client sends its api_key so)"))
        challenges = [(b"www-authenticate", b"Bearer")] + ([(b"www-authenticate", b'Basic realm="diffgraph"')]
                                                           if sdapi else [])
        body = json.dumps({"error": {"message": message, "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *challenges]})
        await send({"type": "http.response.body", "body": body})
