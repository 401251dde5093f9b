"""``bardflow serve``'s server: the engine over a model, warmed (every program compiled before
the first request), behind the OpenAI-compatible app on uvicorn, until Ctrl-C or SIGTERM;
then in-flight streams get ``GRACE_S`` to finish, and those still running are ended by the
engine (finish reason ``abort``, then ``[DONE]``) before uvicorn's own limit would cut them."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config.line_width import fit
from ..errors import BardflowError
from ..model.data.tokenizer import BpeTokenizer
from ..model.network.transformer import Transformer
from ..processes import signals
from .api import create_app
from .engine import Engine
from .guard import error_object
from .limits import LOCAL_HOSTS, ServeSettings
from .tokens import Vocabulary

GRACE_S = 5
UVICORN_LIMIT_S = GRACE_S + 5  # uvicorn cancels what is still running then: never reached
KEEP_ALIVE_S = 5  # an idle connection between requests is closed after this
# Open at once (a process's 1,024 descriptors stay enough): past it the connection waiting
# longest for its request is closed, or the new one answered 503 (TimedH11Protocol).
MAX_CONNECTIONS = 512
_FULL = json.dumps(
    error_object("the server has as many connections open as it takes; retry later", "server_error")
).encode()
FULL_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    + b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_FULL)
    + _FULL
)


class ServeError(BardflowError, RuntimeError):
    """The server cannot start as asked; the message names the setting to change."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening, before the model is loaded and compiled:
    a port another program (another ``bardflow serve`` still compiling) holds is refused at
    once, not after the compile; the server takes it over."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError):
        raise ServeError(
            f"--host {host} is not an address or a name this machine resolves; give one of its own"
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ServeError(f"cannot listen on {host}:{port} ({error.strerror}); pick another with --port") from None
        raise ServeError(
            f"cannot listen on {host}:{port} ({error.strerror or error}); give --host an address of this machine"
        ) from None
    return sock


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, with time limits a client cannot stretch:

    - a request not whole ``request_timeout_s`` after it began (or after the connection
      opened) closes the connection: a client that sends nothing, or a byte now and then,
      cannot hold a socket for ever (between requests uvicorn's keep-alive limit closes it);
    - past ``max_connections`` open, a new connection closes the one that has waited longest
      for its request to be whole, so that slow clients cannot keep a real request out; where
      every one is a request being answered, the new one gets a 503 and is closed;
    - an answer the client has not read for ``write_stall_s`` (the socket's buffers full)
      closes the connection, which frees its slots; once the server is stopping,
      ``shutdown_stall_s`` (the streams' grace and a second), so that a client that reads
      nothing cannot hold the stop."""

    request_timeout_s: float = 10.0
    max_connections: int = MAX_CONNECTIONS
    write_stall_s: float = 30.0
    shutdown_stall_s: float = GRACE_S + 1.0

    def connection_made(self, transport) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        super().connection_made(transport)
        self._stalled: asyncio.TimerHandle | None = None
        self._deadline: asyncio.TimerHandle | None = self.loop.call_later(self.request_timeout_s, self._too_slow)
        if len(self.connections) > self.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._stop_deadline()  # the request is whole (or over): its answer takes what it takes
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.request_timeout_s, self._too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        self._stop_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.write_stall_s, self._not_reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_stall()

    def shutdown(self) -> None:
        super().shutdown()
        self.write_stall_s = min(self.write_stall_s, self.shutdown_stall_s)
        if self._stalled is not None:
            self._stop_stall()
            self._stalled = self.loop.call_later(self.write_stall_s, self._not_reading)

    def _make_room(self) -> None:
        waiting = [
            other
            for other in self.connections
            if other is not self and isinstance(other, TimedH11Protocol) and other._deadline is not None
        ]
        if waiting:
            min(waiting, key=lambda other: other._deadline.when() if other._deadline else 0.0)._too_slow()
            return
        self._stop_deadline()
        self.transport.write(FULL_ANSWER)
        self.transport.close()

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _stop_stall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _too_slow(self) -> None:
        self._stop_deadline()
        if not self.transport.is_closing():
            self.transport.close()

    def _not_reading(self) -> None:
        self._stalled = None
        self.transport.abort()  # close() would wait for the unread bytes to go


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which calls ``listening`` once it accepts connections (so that the
    address it prints answers at once), and whose stop also ends, after ``grace_s``, the
    streams still running."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: Engine,
        listening: Callable[[], None] = lambda: None,
        grace_s: float = GRACE_S,
    ):
        super().__init__(config)
        self.engine, self.listening, self.grace_s, self.ending = engine, listening, grace_s, None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.listening()

    def handle_exit(self, sig, frame) -> None:
        if self.ending is not None:
            # A second signal: the streams end now (``abort``, then ``[DONE]``), not after their
            # grace, and the shutdown stays graceful (uvicorn's forced exit would cut every
            # stream mid-chunk and print each cancelled task's traceback).
            self.ending.cancel()
            self.engine.stop()
            return
        super().handle_exit(sig, frame)
        if self.ending is None:
            busy = self.engine.load()["busy"]
            if busy:  # a wait of up to the grace follows: say so
                these = "1 sequence in flight gets" if busy == 1 else f"{busy} sequences in flight get"
                print(
                    f"bardflow: stopping: {these} up to {self.grace_s:g} s to finish (Ctrl-C again ends them now)",
                    file=sys.stderr,
                    flush=True,
                )
            self.ending = threading.Timer(self.grace_s, self.engine.stop)
            self.ending.daemon = True
            self.ending.start()


class _StoppedBeforeServing(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _serving_line(model_id: str, url: str, settings: ServeSettings, ready_s: float, later: int) -> str:
    """What the first line says, up to how to stop the server."""
    where = "this machine only" if settings.host in LOCAL_HOSTS else "reachable from other machines"
    how = ", the decode kernels" if settings.kernels else ""
    how += f", a {settings.cache} cache" if settings.cache else ""
    said = f"serving {model_id} at {url}/v1 ({where}; {settings.slots} slots{how}, ready in {ready_s:.1f} s"
    return said + (f", {later} faster programs compiling meanwhile; " if later else "; ")


def _engine(model: Transformer, settings: ServeSettings, tokenizer: BpeTokenizer | None) -> Engine:
    return Engine(
        model,
        settings.slots,
        settings.queue,
        kernels=settings.kernels,
        cache_dtype=settings.cache,
        vocabulary=Vocabulary.of(tokenizer),
    )


def _say_when_compiled(engine: Engine, started: float) -> None:
    """One line once the faster programs are compiled too (the server answers before), said
    from a thread of its own."""

    def say() -> None:
        if engine.wait_compiled() and not engine.stopping:
            seconds = time.perf_counter() - started
            print(
                f"bardflow: all {engine.programs()} programs compiled, {seconds:.1f} s after the start",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=say, name="bardflow-compiled", daemon=True).start()


class _ToStderr(logging.Handler):
    """A record as one line on the standard error of the moment (the command's; a test's capture)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"bardflow: {self.format(record)}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's own rule: a record that cannot be written is reported, not raised
            self.handleError(record)


def _uvicorn_logging() -> None:
    """uvicorn's warnings printed by ``_ToStderr``: its own logging set-up (``dictConfig``) would
    shut down every handler of the process first, Prefect's and a test's capture among them."""
    uvicorn_logger = logging.getLogger("uvicorn")
    if not any(isinstance(handler, _ToStderr) for handler in uvicorn_logger.handlers):
        uvicorn_logger.addHandler(_ToStderr())


def _stopping_server(engine: Engine, model: Transformer, model_id: str, settings: ServeSettings, seconds: float):
    """The server of ``engine``, which prints its first lines once it accepts connections."""
    url = f"http://{settings.host}:{settings.port}"
    prompt = len(engine.vocabulary.encode(b"ROMEO:"))  # in the model's tokens
    example = 100 if model.rotary else max(1, min(100, model.max_seq_len - prompt))  # fits its context
    said = _serving_line(model_id, url, settings, seconds, engine.programs() - engine.first_programs())

    def listening() -> None:
        print(fit(said + "Ctrl-C stops it)", sys.stdout), flush=True)
        # The command whole on one line, to be copied as it is.
        # With a key, the variable that holds it: the key itself never goes to a log.
        auth = ' -H "Authorization: Bearer $BARDFLOW_API_KEY"' if settings.api_key else ""
        print(
            f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
            f'-d \'{{"model": "{model_id}", "prompt": "ROMEO:", "max_tokens": {example}}}\'',
            flush=True,
        )

    app = create_app(engine, model_id, settings.max_tokens, settings.api_key, settings.hosts())
    _uvicorn_logging()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level="warning",
        timeout_graceful_shutdown=UVICORN_LIMIT_S,
        access_log=False,
        http=TimedH11Protocol,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    return StoppingServer(config, engine, listening)


def serve(
    model: Transformer,
    model_id: str,
    settings: ServeSettings,
    compiling: Callable[[int], AbstractContextManager[Callable[[int], None]]] | None = None,
    listener: socket.socket | None = None,
    tokenizer: BpeTokenizer | None = None,
) -> int:
    """Serves ``model`` until Ctrl-C or SIGTERM. ``compiling(total)``: what shows the programs
    compiled before the first request (a terminal bar), told how many are done after each;
    ``listener``: the socket bound for it (``listening_socket``; by default bound here);
    ``tokenizer``: the one the model was trained with (None: a byte model)."""
    listener = listener or listening_socket(settings.host, settings.port)
    engine = _engine(model, settings, tokenizer)
    started = time.perf_counter()
    # SIGINT or SIGTERM before the server takes requests ends the command with one line (after
    # the compiles under way: XLA's cannot be interrupted), not a traceback or a death by signal.
    stop = signals.Raising(_StoppedBeforeServing)
    where = "while compiling the server's programs"
    try:
        with signals.handled(stop):  # the handlers before it come back however serve ends
            try:
                with (compiling or (lambda total: contextlib.nullcontext(lambda done: None)))(
                    engine.first_programs()
                ) as compiled:

                    def compiled_unless_stopped(done: int) -> None:
                        compiled(done)
                        stop.check()

                    seconds = engine.warm(compiled_unless_stopped)
                where = "before the server took requests"
                server = _stopping_server(engine, model, model_id, settings, seconds)
                # uvicorn takes SIGINT and SIGTERM while it runs (its graceful shutdown) and raises
                # them again once it has stopped. Before it takes them they stop the server all the
                # same; once it has stopped they are ignored, and the command ends with its line.
                signals.install(lambda signum, frame: None if server.should_exit else server.handle_exit(signum, frame))
                stop.check()  # one whose exception Python dropped
            except _StoppedBeforeServing as stopped:
                signals.ignore()  # a second one while it ends: it is ending
                print(
                    f"bardflow: stopped by {signal.Signals(stopped.signum).name} {where}", file=sys.stderr, flush=True
                )
                return 128 + stopped.signum
            if engine.programs() > engine.first_programs():
                _say_when_compiled(engine, started)
            engine.start()
            try:
                # A closed terminal (SIGHUP) stops it as SIGTERM does, where it killed it mid-stream.
                with signals.handled(server.handle_exit, (signal.SIGHUP,)):
                    server.run(sockets=[listener])
            finally:
                engine.stop()
    finally:
        listener.close()
    print("bardflow: the server stopped", file=sys.stderr, flush=True)
    return 0
