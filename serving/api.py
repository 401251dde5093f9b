"""The OpenAI-compatible surface over the engine: ``POST /v1/completions`` (streamed as
server-sent events or whole), ``GET /v1/models`` and ``GET /health``, and vLLM's tokenizer
endpoints (``/tokenize``, ``/detokenize``, ``/tokenizer_info``) that evaluation tools such as
lm-evaluation-harness ask for.

A token is a byte, or a tokenizer's token (``tokens.py``): ``max_tokens``, the usage and
``logprobs`` count tokens, a prompt may be given as text or as ids (OpenAI's token arrays),
and text is the tokens' bytes decoded as UTF-8 (a byte sequence that is not UTF-8 shows as
U+FFFD; a character split between two chunks of a stream is sent whole with the second). ``logprobs`` and ``echo``
(``serving/scoring.py``) are answered whole, not streamed. Errors are OpenAI's error object
with its status: 400 for a field the server cannot take, 404 for another model, 413 for a
body over ``MAX_BODY``, 503 with ``Retry-After`` when every slot is busy and the queue is
full; never a traceback. A client that goes away frees its slots at once.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..config.config_file import each_once
from .engine import Engine, Sampling, Sequence, ServerFull
from .guard import Guard, error_object
from .limits import ServeSettings, ServingError
from .scoring import MOST_ALTERNATIVES, Scorer, Scores
from .tokens import Vocabulary

MAX_BODY = 1 << 20  # bytes of a request's JSON
MAX_PROMPTS = 64  # prompts x n in one request
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.05


MAX_DIGITS = 30  # of a number in a request: no field takes more
Body = TypeVar("Body", bound=BaseModel)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions request that a byte model can honour; the others
    are refused by name rather than ignored. Strict: ``"8"`` or ``true`` is no number."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]  # text, or bytes' values (OpenAI's token arrays)
    max_tokens: int = Field(default=16, ge=0, description="0 only with echo: the prompt scored, nothing drawn")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="the most likely tokens kept; 0 or -1: all")
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    n: int = Field(default=1, ge=1, le=MAX_PROMPTS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused, as OpenAI's own servers take it
    logprobs: int | None = Field(default=None, ge=0, le=MOST_ALTERNATIVES)
    echo: bool = False
    # Refused unless left at OpenAI's defaults: nothing here computes them.
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("give at least one prompt")
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            return _utf8(prompt)
        return prompt

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("give at most 4 stop sequences, none empty")
        return _utf8(stop)

    def unsupported(self) -> str | None:
        defaults = {
            "suffix": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logit_bias": None,
        }
        for name, default in defaults.items():
            if getattr(self, name) not in (default, {}):
                return name
        if self.best_of not in (None, self.n):
            return "best_of"
        return None

    def prompts(self, vocabulary: Vocabulary) -> list[list[int]]:
        """Each prompt's ids: text's UTF-8 bytes through the vocabulary, token arrays as given,
        each id checked to be one of the vocabulary's."""
        prompt = self.prompt
        given: list = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
        found: list[list[int]] = []
        for one in given:
            if isinstance(one, str):
                found.append(vocabulary.encode(one.encode()))
                continue
            wrong = next((value for value in one if not 0 <= value < vocabulary.size), None)
            if wrong is not None:
                raise ApiError(400, _not_an_id(wrong, vocabulary), "prompt")
            found.append(list(one))
        return found


def _not_an_id(value: int, vocabulary: Vocabulary) -> str:
    if vocabulary.tokenizer is None:
        return f"token {value} is not a byte: this model's tokens are bytes, 0 to 255"
    return f"token {value} is not one of this model's {vocabulary.size} ids (0 to {vocabulary.size - 1})"


def _utf8(text):
    """``text`` (a string or a list of them) where each is UTF-8: JSON's escapes can name half of
    a surrogate pair alone (``"\\ud800"``), a character no byte sequence holds."""
    for one in [text] if isinstance(text, str) else text or []:
        try:
            one.encode()
        except UnicodeEncodeError as error:
            raise ValueError(
                f"holds a lone surrogate (\\u{ord(one[error.start]):04x} at character {error.start}), which "
                "UTF-8 cannot hold; send whole characters"
            ) from None
    return text


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return JSONResponse(error_object(self.message, self.kind, self.param), status_code=self.status, headers=headers)


class Choice:
    """One sequence of a request, as the client sees it: its index, its bytes and text so far
    (decoded as they arrive) and how it ended."""

    def __init__(self, index: int, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, prompt: list[int]):
        self.index, self.queue, self.loop, self.prompt = index, queue, loop, prompt
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.data = bytearray()
        self.sequence: Sequence | None = None  # the engine's, where one is drawn

    @property
    def completion_tokens(self) -> int:
        """Tokens whose bytes it shows (the engine's count; read once it has finished)."""
        return self.sequence.tokens() if self.sequence is not None else 0

    def ids(self) -> list[int]:
        """The ids of the tokens it shows."""
        return self.sequence.shown_ids() if self.sequence is not None else []

    def emit(self, chunk: bytes) -> None:  # the engine's thread
        self._put((self.index, chunk, None))

    def finish(self, reason: str) -> None:  # the engine's thread
        self._put((self.index, b"", reason))

    def _put(self, piece: tuple[int, bytes, str | None]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)
        except RuntimeError:  # the server's loop has closed (it stopped): no one reads this any more
            pass

    def text(self, chunk: bytes, final: bool) -> str:
        self.data += chunk
        return self.decoder.decode(chunk, final=final)


def create_app(
    engine: Engine,
    model_id: str,
    max_tokens: int = ServeSettings.max_tokens,
    api_key: str | None = None,
    hosts: Iterable[str] = (),
) -> Guard:
    """The HTTP application over ``engine``; ``max_tokens`` is the most bytes a sequence may ask
    for, ``model_id`` the one model it serves; behind ``Guard``'s checks of the key
    (``api_key``; None: none asked) and the host names requests may address (``hosts``)."""
    created = int(time.time())
    vocabulary = engine.vocabulary
    scorer = Scorer(engine.graphdef, engine.params, engine.window)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_id, **engine.load()})

    async def models(request: Request) -> Response:
        entry = {"id": model_id, "object": "model", "created": created, "owned_by": "bardflow"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def completions(request: Request) -> Response:
        try:
            body = await _parsed(request, CompletionRequest)
            prompts = body.prompts(vocabulary)
            _check(body, prompts, model_id, max_tokens, scorer, vocabulary)
            loop, queue = asyncio.get_running_loop(), asyncio.Queue()
            choices, sequences = _sequences(body, prompts, queue, loop)
            try:
                engine.submit(sequences)  # checks every sequence first: all are queued, or none
            except ServingError as error:
                raise ApiError(400, str(error), "prompt") from None
            except ServerFull as error:
                raise ApiError(503, f"the server is full: {error}; retry later", None, "server_error") from None
        except ApiError as error:
            return error.response()
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time())}
        head["model"] = model_id
        usage_of = _usage(prompts, body.n, choices)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            stream = _events(request, queue, choices, sequences, head, usage_of if include else None)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts, reasons = await _gathered(request, queue, choices, sequences)
        if texts is None or reasons is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        rows = [
            {"index": c.index, "text": texts[c.index], "logprobs": None, "finish_reason": reasons[c.index]}
            for c in choices
        ]
        if body.echo or body.logprobs is not None:
            await _with_prompt_and_scores(rows, choices, body, scorer, vocabulary)
        return JSONResponse({**head, "choices": rows, "usage": usage_of()})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *_tokenizer_routes(scorer.longest(), vocabulary),
    ]
    return Guard(Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed}), api_key, hosts)


def _tokenizer_routes(longest: int, vocabulary: Vocabulary) -> list[Route]:
    """vLLM's tokenizer endpoints, which evaluation tools ask for: a byte model's tokens are a
    text's bytes, a tokenizer's model's its ids; neither has special tokens (no end of text, no
    beginning, no padding)."""

    async def tokenize(request: Request) -> Response:
        try:
            body = await _parsed(request, TokenizeRequest)
        except ApiError as error:
            return error.response()
        tokens = vocabulary.encode(body.prompt.encode())
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": longest})

    async def detokenize(request: Request) -> Response:
        try:
            body = await _parsed(request, DetokenizeRequest)
            wrong = next((i for i, value in enumerate(body.tokens) if value >= vocabulary.size), None)
            if wrong is not None:
                raise ApiError(400, _not_an_id(body.tokens[wrong], vocabulary), f"tokens.{wrong}")
        except ApiError as error:
            return error.response()
        return JSONResponse({"prompt": vocabulary.decode(body.tokens).decode("utf-8", errors="replace")})

    async def tokenizer_info(request: Request) -> Response:
        info = {"tokenizer_class": vocabulary.kind, "eos_token": None, "bos_token": None, "pad_token": None}
        return JSONResponse({**info, "model_max_length": longest, "vocab_size": vocabulary.size})

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]


async def _with_prompt_and_scores(
    rows: list[dict[str, Any]], choices: list[Choice], body: CompletionRequest, scorer: Scorer, vocabulary: Vocabulary
) -> None:
    """``echo``: each row's text is its prompt's and its own; ``logprobs``: with the scores of
    the tokens it shows (one pass over prompt and completion, off the event loop)."""
    for row, choice in zip(rows, choices, strict=True):
        ids = choice.prompt + choice.ids()
        if body.echo:
            row["text"] = (vocabulary.decode(choice.prompt) + choice.data).decode("utf-8", errors="replace")
        if body.logprobs is not None:
            scores = await asyncio.to_thread(scorer.score, ids)
            shown = ids if body.echo else choice.ids()
            before = 0 if body.echo else len(choice.prompt)
            row["logprobs"] = _logprobs(shown, scores, before, body.logprobs, vocabulary)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a text's tokens, here its bytes."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True  # accepted: a byte model has none to add

    @field_validator("prompt")
    @classmethod
    def _whole(cls, prompt: str) -> str:
        return _utf8(prompt)


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: the text of tokens (bytes' values, or a tokenizer's ids)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[Annotated[int, Field(ge=0)]]
    model: str | None = None


def _check(
    body: CompletionRequest, prompts: list[list[int]], model_id: str, most: int, scorer: Scorer, vocabulary: Vocabulary
) -> None:
    """Refuses, naming the field, what this server does not serve."""
    if body.model != model_id:
        raise ApiError(
            404,
            f"the model {body.model!r} is not served here; this server serves {model_id!r}",
            "model",
            "not_found_error",
        )
    field = body.unsupported()
    if field:
        raise ApiError(400, f"{field} is not supported by this server; leave it out", field)
    if body.top_k > vocabulary.size:
        raise ApiError(400, f"top_k is {body.top_k}, over this model's {vocabulary.size} tokens", "top_k")
    if body.max_tokens > most:
        raise ApiError(400, f"max_tokens is {body.max_tokens}, over this server's {most}", "max_tokens")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens is 0, which only echo takes (the prompt scored, nothing drawn)", "max_tokens")
    if len(prompts) * body.n > MAX_PROMPTS:
        raise ApiError(400, f"{len(prompts)} prompts x n={body.n} is over {MAX_PROMPTS} sequences a request", "n")
    if body.stream and (body.echo or body.logprobs is not None):
        raise ApiError(400, "echo and logprobs are answered whole here: leave out stream", "stream")
    if body.logprobs is not None:
        for prompt in prompts:
            try:
                scorer.check(len(prompt), body.max_tokens)
            except ServingError as error:
                raise ApiError(400, str(error), "logprobs") from None


def _logprobs(shown: list[int], scores: Scores, before: int, alternatives: int, vocabulary: Vocabulary) -> dict:
    """OpenAI's ``logprobs`` object for the tokens ``shown`` (a choice's), which start
    ``before`` tokens into the scored ids (0 with echo: the first has no log-probability),
    each named as OpenAI names tokens (``bytes:\\xNN`` for bytes that are no whole
    characters); ``text_offset``: where each token's text starts, in characters."""
    tokens, token_logprobs, top_logprobs = [], [], []
    offsets = vocabulary.offsets(shown)
    for i, index in enumerate(shown):
        position = before + i - 1  # its row in ``scores``
        tokens.append(vocabulary.name(index))
        if position < 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        chosen = float(scores.logprobs[position])
        token_logprobs.append(chosen)
        top = {
            vocabulary.name(int(b)): float(lp)
            for b, lp in zip(
                scores.top_bytes[position][:alternatives], scores.top_logprobs[position][:alternatives], strict=True
            )
        }
        top.setdefault(tokens[-1], chosen)  # the chosen token's, always, as OpenAI's API gives it
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


async def _not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"no such endpoint: {request.url.path}", None, "not_found_error").response()


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()


async def _parsed(request: Request, schema: type[Body]) -> Body:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY):
        raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY} bytes")
    except ClientDisconnect:
        raise ApiError(400, "the client went away before its request was read") from None
    try:
        content = json.loads(raw, object_pairs_hook=_once_each, parse_int=_integer)
    except _Refused as refused:
        raise ApiError(400, str(refused)) from None
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not JSON") from None
    if not isinstance(content, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(content)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise ApiError(400, f"{param}: {message}" if param else message, param) from None


class _Refused(ValueError):
    """A body that is JSON, but not one to read: the message says why."""


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return each_once(pairs, lambda name: _Refused(f"{name} is given twice; give it once"))


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise _Refused(f"a number in the body has {len(text.lstrip('-'))} digits, more than any field takes")
    return int(text)


def _sequences(
    body: CompletionRequest, prompts: list[list[int]], queue: asyncio.Queue, loop: asyncio.AbstractEventLoop
) -> tuple[list[Choice], list[Sequence]]:
    """One engine sequence per prompt and choice: choice ``i * n + j`` is prompt ``i``'s
    ``j``-th, drawn from the request's seed plus ``j`` (one seed gives the same text alone).
    With ``max_tokens`` 0 (echo) a choice ends at once, and nothing is drawn."""
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    base = body.seed if body.seed is not None else secrets.randbits(31)
    top_k = 0 if body.top_k in (0, -1) else body.top_k
    choices, sequences = [], []
    for i, prompt in enumerate(prompts):
        for j in range(body.n):
            choice = Choice(i * body.n + j, queue, loop, prompt)
            choices.append(choice)
            if body.max_tokens == 0:
                if not prompt:
                    raise ApiError(400, "the prompt is empty; give at least one character", "prompt")
                choice.finish("length")
                continue
            sampling = Sampling(body.temperature, top_k, body.top_p, (base + j) % 2**31)
            stop = tuple(s.encode() for s in stops)
            choice.sequence = Sequence(prompt, body.max_tokens, sampling, stop, choice.emit, choice.finish)
            sequences.append(choice.sequence)
    return choices, sequences


def _usage(prompts: list[list[int]], n: int, choices: list[Choice]):
    prompt_tokens = sum(len(p) for p in prompts) * n

    def usage() -> dict[str, int]:
        completion = sum(c.completion_tokens for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    return usage


async def _next(request: Request, queue: asyncio.Queue, checked: list[float]) -> tuple[int, bytes, str | None] | None:
    """The next piece of any choice, or None once the client is gone: asked every
    ``DISCONNECT_POLL_S`` whether pieces come or not (``checked``: when it was last asked)."""
    while True:
        if time.monotonic() - checked[0] >= DISCONNECT_POLL_S:
            checked[0] = time.monotonic()
            if await request.is_disconnected():
                return None
        try:
            return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            continue


async def _gathered(request: Request, queue: asyncio.Queue, choices: list[Choice], sequences: list[Sequence]):
    texts, reasons, checked = {c.index: "" for c in choices}, {}, [time.monotonic()]
    try:
        while len(reasons) < len(choices):
            piece = await _next(request, queue, checked)
            if piece is None:
                return None, None
            index, chunk, reason = piece
            texts[index] += choices[index].text(chunk, final=reason is not None)
            if reason is not None:
                reasons[index] = "abort" if reason == "cancelled" else reason
    finally:
        for sequence in sequences:
            sequence.cancel()  # those still running: their client is gone or the request ended
    return texts, reasons


async def _events(
    request: Request, queue: asyncio.Queue, choices: list[Choice], sequences: list[Sequence], head: dict, usage_of
) -> AsyncIterator[str]:
    """Server-sent events: a chunk of text per choice as it comes, its finish reason last,
    the usage if asked for, then ``[DONE]``."""
    ended, checked = 0, [time.monotonic()]
    try:
        while ended < len(choices):
            piece = await _next(request, queue, checked)
            if piece is None:
                return
            index, chunk, reason = piece
            text = choices[index].text(chunk, final=reason is not None)
            if reason is not None:
                ended += 1
                reason = "abort" if reason == "cancelled" else reason
            if text or reason is not None:
                row = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
                yield _event({**head, "choices": [row]})
        if usage_of is not None:
            yield _event({**head, "choices": [], "usage": usage_of()})
        yield "data: [DONE]\n\n"
    finally:
        for sequence in sequences:
            sequence.cancel()


def _event(data: Mapping[str, object]) -> str:
    # ASCII only: a text's U+2028 or U+0085 would end the line for a reader that splits as
    # str.splitlines does (httpx's iter_lines), where server-sent events end lines at CR or LF.
    return f"data: {json.dumps(data)}\n\n"
