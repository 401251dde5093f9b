"""A corpus download over http(s), bounded in every way a server can hold it up: a dropped
connection resumes where it stopped (a Range request), transient errors are retried with
back-off, and a transfer slower than ``MIN_BYTES_PER_S`` over ``STALL_S`` seconds (a server
that trickles a byte at a time, headers or body) counts as stalled: its socket is shut and
the attempt retried. Redirects are followed within the URL's scheme and host (its port
included), and from https to https on another host (a mirror or CDN); any other is refused
in one line that names where it led. No JAX, no Prefect."""

from __future__ import annotations

import errno
import http.client
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .sources import FetchError
from .splits import write_all

ATTEMPTS = 4
# No network, no such host, or nothing listening: asking again seconds later changes nothing, so
# the one line comes at once rather than after every attempt's wait. Timeouts, resets, stalls
# and a busy server's 5xx are retried.
NOT_RETRIED = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED)
TIMEOUT_S = 30.0  # one read or connect
STALL_S = 60.0  # the window a transfer's rate is judged over (as curl's --speed-time)
MIN_BYTES_PER_S = 1000  # below this over a whole window, stalled (curl's --speed-limit)
CHUNK = 1 << 20


class Stalled(OSError):
    """The transfer fell below the minimum rate for a whole window."""


@dataclass
class Watch:
    """Shuts a connection's socket once its transfer falls below ``min_bytes_per_s`` over
    ``window_s`` seconds, from the connect on (a read then returns at once)."""

    window_s: float
    min_bytes_per_s: float
    sock: socket.socket | None = None
    received: int = 0
    stalled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def stall(self) -> Stalled:
        return Stalled(f"slower than {self.min_bytes_per_s:,.0f} bytes/s for {self.window_s:.0f} s")

    def start(self) -> None:
        threading.Thread(target=self._watch, name="bardflow-download-watch", daemon=True).start()

    def _watch(self) -> None:
        since, mark = time.monotonic(), self.received
        while not self.done.wait(min(1.0, self.window_s / 4)):
            now = time.monotonic()
            if now - since < self.window_s:
                continue
            if self.received - mark < self.min_bytes_per_s * self.window_s:
                self.stalled = True
                if self.sock is not None:
                    try:
                        self.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            since, mark = now, self.received


def _watched(base: type[http.client.HTTPConnection], watch: Watch) -> type[http.client.HTTPConnection]:
    """``base`` whose socket ``watch`` holds once connected."""

    class Connection(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            super().connect()
            watch.sock = self.sock

    return Connection


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect within the scheme and host (and port) asked for, or from https to
    https elsewhere; refuses any other, naming it. ``hops`` records where each one led."""

    def __init__(self) -> None:
        self.hops: list[str] = []

    def final(self, url: str) -> str:
        """Where the bytes of ``url`` came from."""
        return self.hops[-1] if self.hops else url

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old, new = urllib.parse.urlparse(req.full_url), urllib.parse.urlparse(newurl)
        if (old.scheme, old.netloc) != (new.scheme, new.netloc) and (old.scheme, new.scheme) != ("https", "https"):
            raise FetchError(
                f"{req.full_url} redirects to {newurl}, another scheme, host or port, which is not "
                "followed; if that is where the corpus is, pass it with --corpus"
            )
        self.hops.append(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener(watch: Watch, redirects: _Redirects) -> urllib.request.OpenerDirector:
    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(_watched(http.client.HTTPConnection, watch), req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(_watched(http.client.HTTPSConnection, watch), req, context=self._context)  # type: ignore[attr-defined]

    return urllib.request.build_opener(Http(), Https(), redirects)


def _one_line(text: object) -> str:
    """A server's or library's message as one line (urllib's redirect-loop error has three)."""
    return " ".join(str(text).split())


def _receive(response, out, have: int, total: int | None, watch: Watch, hear, progress) -> int:
    """The response's body appended to ``out``; returns the bytes ``out`` holds. ``read1``
    returns what has arrived, so the watch sees the rate as it is; what it returns is passed
    on a MiB at a time."""
    pending = bytearray()
    while True:
        piece = response.read1(CHUNK)
        watch.received += len(piece)
        pending += piece
        if pending and (not piece or len(pending) >= CHUNK):
            chunk = bytes(pending)
            pending.clear()
            write_all(out, chunk)
            if hear is not None:
                hear(chunk)
            have += len(chunk)
            if progress is not None:
                progress(have, total)
        if not piece:
            return have


def download(  # noqa: PLR0913 - the transfer's limits, defaults for every caller but the tests
    url: str,
    target: Path,
    hear: Callable[[bytes], None] | None = None,
    restart: Callable[[], None] | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    attempts: int = ATTEMPTS,
    timeout_s: float = TIMEOUT_S,
    stall_s: float = STALL_S,
    min_bytes_per_s: float = MIN_BYTES_PER_S,
) -> str:
    """Downloads ``url`` into ``target``, ``hear`` getting every byte once (``restart`` when a
    server sends the whole file again); returns the URL the bytes came from, after redirects."""
    last: BaseException | None = None
    have = 0
    redirects = _Redirects()
    attempt = 0
    with open(target, "wb") as out:
        for attempt in range(attempts):
            if attempt:
                time.sleep(2 ** (attempt - 1))
            request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
            watch = Watch(stall_s, min_bytes_per_s)
            watch.start()
            try:
                with _opener(watch, redirects).open(request, timeout=timeout_s) as response:
                    if have and response.status != 206:  # the server sends it all again: start over
                        out.seek(0)
                        out.truncate()
                        have = 0
                        if restart is not None:
                            restart()
                    length = response.headers.get("Content-Length")
                    total = have + int(length) if length is not None else None
                    have = _receive(response, out, have, total, watch, hear, progress)
                    if watch.stalled:
                        raise watch.stall()
                    if total is not None and have < total:
                        raise http.client.IncompleteRead(b"", total - have)
                return redirects.final(url)
            except urllib.error.HTTPError as error:
                last = error
                if error.code == 416 and have:  # nothing past what we have: it was all there
                    return redirects.final(url)
                if error.code < 500 and error.code != 429:
                    break  # the server said no; asking again will not change that
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                last = watch.stall() if watch.stalled else error
                cause = getattr(error, "reason", error)
                if not watch.stalled and (
                    isinstance(cause, socket.gaierror) or getattr(cause, "errno", None) in NOT_RETRIED
                ):
                    break
            finally:
                watch.done.set()
    reason = _one_line(getattr(last, "reason", last))
    raise FetchError(
        f"could not download {url} ({reason}) after {attempt + 1} attempt(s); check the network, "
        "or pass a local copy with --corpus PATH or a mirror with --corpus file:///PATH"
    ) from last
