"""Who may call the server, before any request reaches the API: an API key (``Authorization:
Bearer KEY``, compared in constant time; ``/health`` stays open), a ``Host`` that names this
server (a page on another site that rebinds its name to this address is refused), and JSON
bodies alone (a page's form or ``text/plain`` post, which a browser sends to any address
without asking, is refused before it is read). Each refusal is OpenAI's error object, and no
CORS header is ever added, so a browser lets no other site read an answer. A request that
fails in a way nothing foresaw gets a 500 error object and one line in the log, never a
traceback."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health",)  # a load balancer's probe needs no key
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(header: str) -> str:
    """``Host``'s name without its port: ``[::1]:8000`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """The ASGI application ``app`` behind the checks: ``api_key`` (None: no key asked), and
    the host names a request may address (``hosts``; the loopback names always)."""

    def __init__(self, app: Asgi, api_key: str | None = None, hosts: Iterable[str] = ()):
        self.app, self.api_key = app, api_key
        self.hosts = {name.lower().strip("[]") for name in (*LOOPBACK_NAMES, *hosts)}  # "*": any

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            await _error(send, *refusal)
            return
        started = False

        async def sending(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as error:  # noqa: BLE001 - whatever it was, the client gets an error object
            logging.getLogger("bardflow.serving").error(
                "%s %s failed: %s: %s", scope["method"], scope["path"], type(error).__name__, error
            )
            if not started:
                await _error(send, 500, "the server failed on this request; its log says why", "server_error")

    def refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """(status, message, OpenAI's error type) of a request not to be served; None to serve it."""
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        name = host_name(headers.get("host", ""))
        if name not in self.hosts and "*" not in self.hosts:
            return (
                421,
                f"this server does not answer for the host {name or '(none)'!r}; call it by the address it "
                "listens on, or start it with --allow-host NAME",
                "invalid_request_error",
            )
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return 401, "a valid API key is needed: send Authorization: Bearer KEY", "authentication_error"
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return (
                    415,
                    f"the request body must be JSON sent as Content-Type: application/json, not {kind or 'none'!r}",
                    "invalid_request_error",
                )
        return None


def error_object(message: str, kind: str, param: str | None = None) -> dict[str, dict[str, str | None]]:
    """OpenAI's error object: what every refusal of this server's answers."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


async def _error(send: Send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_object(message, kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="bardflow"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
