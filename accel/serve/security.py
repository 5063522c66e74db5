"""The door of `accel serve`: an ASGI middleware that refuses a request before the app parses it.

In order: a Host header the server does not answer to (421: DNS rebinding turns a page in the
operator's browser into a client of a localhost server), a missing or wrong API key (401, on
every endpoint but /health and the playground's static page), and a body over the limit (413:
read at most the limit, whatever Content-Length claims or a chunked body streams, so a 500 MB
body never sits in memory).
Every refusal is in OpenAI's error shape.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from accel.serve.playground import PAGES

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Answered without a key: load balancers and probes hold none; the playground's files hold no data.
OPEN = ("/health", *PAGES)


@dataclass(frozen=True)
class Door:
    """Who may ask: API keys (none: anyone) and Host names beyond the bound address and localhost."""

    host: str = "127.0.0.1"
    api_keys: tuple[str, ...] = ()
    trusted_hosts: tuple[str, ...] = ()
    max_body: int = 1 << 20

    def trusts(self, name: str, local: str | None) -> bool:
        """The connection's own local address is trusted as a Host (a client that typed the IP);
        a name must be localhost, the bound address, or one the operator added."""
        name = name.lower()
        allowed = {*LOOPBACK_NAMES, self.host.lower(), *(h.lower() for h in self.trusted_hosts)}
        return "*" in allowed or name in allowed or (local is not None and name == local.lower())

    def key_ok(self, authorization: str | None) -> bool:
        if not self.api_keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip().encode()
        # Every key compared in constant time, none skipped: the answer's timing says nothing of which.
        matches = [hmac.compare_digest(token, key.encode()) for key in self.api_keys]
        return scheme.lower() == "bearer" and any(matches)


def beyond_loopback(host: str) -> bool:
    """Whether listening on `host` lets other machines connect."""
    if host.lower() == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a name: whatever it resolves to may be reachable


def exposure_warning(host: str, port: int, api_keys: tuple[str, ...]) -> str | None:
    """The one line `accel serve` prints when other machines may use it without a key (None: they may not)."""
    if not beyond_loopback(host) or api_keys:
        return None
    return (
        f"warning: listening on {host} without an API key: anyone who reaches port {port} can use this server; "
        "pass --api-key or set ACCEL_API_KEY"
    )


def host_name(header: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" → "::1")."""
    header = header.strip()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    if header.count(":") == 1:
        return header.partition(":")[0]
    return header


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def refuse(send: Send, status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Guard:
    """The ASGI middleware applying a `Door` to every HTTP request."""

    def __init__(self, app: ASGIApp, door: Door) -> None:
        self.app = app
        self.door = door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", ())}
        name = host_name(headers.get("host", ""))
        local = (scope.get("server") or (None, None))[0]
        if not self.door.trusts(name, local):
            await refuse(
                send,
                421,
                error_body(
                    f"Host {name!r} is not one this server answers to; add it with accel serve --trusted-host",
                    "invalid_request_error",
                    code="untrusted_host",
                ),
            )
            return
        if scope.get("path") not in OPEN and not self.door.key_ok(headers.get("authorization")):
            await refuse(
                send,
                401,
                error_body(
                    "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                    "invalid_request_error",
                    code="invalid_api_key",
                ),
                ((b"www-authenticate", b"Bearer"),),
            )
            return
        too_large = error_body(
            f"the request body is larger than this server's limit of {self.door.max_body} bytes "
            "(accel serve --max-body)",
            "invalid_request_error",
            code="request_too_large",
        )
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await refuse(send, 400, error_body("Content-Length must be a number of bytes", "invalid_request_error"))
                return
            if int(declared) > self.door.max_body:
                await refuse(send, 413, too_large)
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:  # at most max_body bytes held, whatever the client streams
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.door.max_body:
                await refuse(send, 413, too_large)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` giving the app the body already read, then the client's later messages."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
