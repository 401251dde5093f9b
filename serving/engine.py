"""Continuous batching over the model's key/value cache: a fixed number of slots, each holding
one sequence's cache, advanced together by one compiled decode step; a request joins a free
slot at the next call (a prompt of up to ``STEPS_A_CALL`` bytes fed to that call's first steps
as the sampler feeds one, a longer one written into the slot's cache by a compiled prefill)
and leaves it when it ends, is stopped, or its client goes away.

The sequences in flight sit in the lowest slots, and a decode call runs ``STEPS_A_CALL`` steps
over the fewest slots and the shortest part of their caches that hold them (``shapes.py``);
every program is compiled before the first request (``Engine.warm``). A sequence's bytes
depend on its own prompt, settings and seed alone: a request gives the bytes it gives alone.

The engine runs in a thread of its own, one call ahead of the bytes it hands on: it sends a
call, then reads the one before while the device runs it. Requests are handed in and their
bytes handed out through callbacks, which the HTTP layer (``serving/api.py``) turns into
responses.
"""

from __future__ import annotations

import bisect
import collections
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from ..errors import BardflowError
from ..model.network.caches import LayerCache, SlotCache
from ..model.network.transformer import Transformer
from ..model.training.compiling import compile_workers
from .layouts import CacheLayout, SharedRows, SlotsApart
from .limits import ServeSettings, ServingError
from .programs import STEPS_A_CALL, WHOLE, EnginePrograms
from .shapes import buckets, decode_sizes, fills
from .tokens import BYTES, Vocabulary, as_ids
from .warming import LaterCompiles

# A program of the engine: its key, its lowering, and its first run on the engine's arrays.
Program = tuple[tuple, Callable[[], jax.stages.Lowered], Callable[[], None]]


class ServerFull(BardflowError, RuntimeError):
    """Every slot is busy and the queue is full."""


@dataclass(frozen=True)
class Sampling:
    """How one sequence's bytes are drawn: temperature 0 is greedy; ``top_k`` 0 and ``top_p``
    1 leave the distribution whole; ``seed`` fixes the draws."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # The seed enters the compiled calls as a 32-bit integer, and becomes a key there.
        if not 0 <= self.seed < 2**31:
            raise ServingError(f"seed {self.seed} is outside 0 .. 2**31 - 1; pick a seed in that range")


@dataclass
class Sequence:
    """One sequence being served: its prompt (a byte model's bytes, or ids), how many tokens
    to add at most, when to stop, and where its bytes go (``emit(chunk)`` with text-ready
    bytes as they are final, then ``finish(reason)`` once: ``length``, ``stop``, or
    ``cancelled``)."""

    prompt: bytes | list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[bytes, ...]
    emit: Callable[[bytes], None]
    finish: Callable[[str], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: bytearray = field(default_factory=bytearray)  # the drawn tokens' bytes, cut at a stop
    drawn_ids: list[int] = field(default_factory=list)  # the tokens drawn for it
    token_ends: list[int] = field(default_factory=list)  # where each drawn token's bytes end in ``generated``
    sent: int = 0  # bytes of ``generated`` handed to ``emit``
    queued_at: float = field(default_factory=time.perf_counter)
    first_byte_s: float | None = None
    slot: int | None = None  # where the engine serves it; None before it joins and once it ends
    unread: int = 0  # bytes drawn for it on the device and not read back yet

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def drawn(self) -> int:
        """Tokens drawn and handed to this sequence."""
        return len(self.token_ends)

    def tokens(self) -> int:
        """The tokens whose bytes are in ``generated`` (a stop may cut one): what the usage counts."""
        if not self.generated:
            return 0
        return min(bisect.bisect_left(self.token_ends, len(self.generated)) + 1, len(self.token_ends))

    def shown_ids(self) -> list[int]:
        """The ids of the tokens ``tokens`` counts."""
        return self.drawn_ids[: self.tokens()]


class Engine:
    """``slots`` sequences at a time over ``model``; up to ``queue_limit`` more wait for a slot."""

    def __init__(
        self,
        model: Transformer,
        slots: int = ServeSettings.slots,
        queue_limit: int = ServeSettings.queue,
        select_writes: bool | None = None,
        kernels: bool = False,
        cache_dtype: DTypeLike | None = None,
        vocabulary: Vocabulary = BYTES,
    ):
        if model.lm_head.kernel.shape[-1] != vocabulary.size:
            raise ServingError(
                f"this model predicts {model.lm_head.kernel.shape[-1]} ids and the vocabulary given has "
                f"{vocabulary.size}; serve it with the tokenizer of the run that trained it"
            )
        self.vocabulary = vocabulary
        self.graphdef, self.params = nnx.split(model)
        self.window, self.rotary = model.max_seq_len, model.rotary
        self.slots, self.queue_limit = slots, queue_limit
        # How a decode step stores each slot's new key: a TPU runs the scatter (each slot at a
        # position of its own) as a loop over the slots and streams a select faster, over a
        # cache whose positions run along its last axis (``SlotCache``); a CPU scatters in
        # place, where the select copies the part read (docs/journal.md).
        self.select_writes = jax.default_backend() == "tpu" if select_writes is None else select_writes
        self.slot_cache = SlotCache if self.select_writes else LayerCache
        # The cache in the weights' type unless told: a bfloat16 one reads half the bytes a step
        # and rounds each key, so its bytes too are the engine's own.
        dtype = cache_dtype or model.token_embed.embedding.dtype
        # Or Pallas TPU kernels store each key in place and read each slot's cache where it
        # lies (``RowsCache``): the bytes are then the engine's own, alike alone and in a
        # crowd, but no longer the sampler's bit for bit (docs/journal.md).
        self.kernels = kernels
        self.layout: CacheLayout = SharedRows(self.window, dtype) if kernels else SlotsApart(self.slot_cache)
        one = tuple(self.layout.laid_out(layer) for layer in model.init_cache(1, self.window, dtype))
        self.caches = jax.tree.map(lambda layer: jnp.stack([layer] * slots), one)
        # Each slot's last byte (the next step's input) and key stay on the device, where the
        # calls leave them, so that a call is sent before the bytes of the one before are read.
        self.tokens = jnp.zeros(slots, jnp.int32)
        self.keys = jnp.zeros((slots, 2), jnp.uint32)
        # All of it committed to the weights' device: a call's outputs are committed there
        # (weights restored from a checkpoint are), and a program compiled for uncommitted
        # first arrays would not fit them, compiling another at the next call.
        device = next(iter(jax.tree.leaves(self.params)[0].devices()))
        self.params, self.caches, self.tokens, self.keys = jax.device_put(
            (self.params, self.caches, self.tokens, self.keys), device
        )
        self.positions = np.zeros(slots, np.int32)  # each slot's next position, as of the last call sent
        self.feeding: dict[int, tuple[bytes | list[int], int]] = {}  # slot: short prompt and seed, for the next call
        self.settings = np.tile(np.array(WHOLE, np.float32), (slots, 1))  # temperature, top_k, top_p
        self.precision = self.layout.precision
        self.compiled = EnginePrograms(self.graphdef, self.window, self.rotary, self.layout, slots)
        self._decode_jit, self._prefill_jit = self.compiled.decode_jit, self.compiled.prefill_jit
        self._decode, self._prefill, self._move = self.compiled.decode, self.compiled.prefill, self.compiled.move
        self.active: list[Sequence | None] = [None] * slots
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.count = 0  # sequences in flight: slots 0 .. count - 1
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="bardflow-serving", daemon=True)
        # The programs compiled, ("decode", size, fill) ...; before ``warm``, all: each compiles
        # at its first call.
        self._ready: frozenset[tuple] | None = None
        self._later: LaterCompiles | None = None
        self._marking = threading.Lock()

    @property
    def compilations(self) -> int:
        """Programs traced: ``programs`` of them by ``warm``, none after."""
        return self.compiled.compilations

    # --- what the HTTP layer calls ---

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends every sequence still served or waiting (``cancelled``) and the engine's thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def check(self, prompt: bytes | list[int], max_tokens: int) -> None:
        """Refuses, naming the limit, a sequence this model cannot serve."""
        unit = self.vocabulary.unit
        if not len(prompt):
            raise ServingError("the prompt is empty; give at least one character")
        if len(prompt) > self.window:
            raise ServingError(
                f"the prompt is {len(prompt)} {unit}, over this model's context of {self.window}; shorten it"
            )
        if not self.rotary and len(prompt) == self.window:
            raise ServingError(
                f"the prompt fills this model's context of {self.window} {unit}, and its learned positions end "
                f"there: no {'byte' if unit == 'bytes' else 'token'} can follow it; shorten the prompt"
            )
        if not self.rotary and len(prompt) + max_tokens > self.window:
            raise ServingError(
                f"prompt ({len(prompt)} {unit}) + max_tokens ({max_tokens}) is over this model's context of "
                f"{self.window} {unit} (learned positions end there); lower max_tokens to {self.window - len(prompt)}"
            )

    def submit(self, sequences: list[Sequence]) -> None:
        """Queues the sequences (all or none): ``ServerFull`` when the free slots and the queue
        have no room for them now, ``ServingError`` when they never would. Waiting sequences
        whose client has gone leave the queue first."""
        for sequence in sequences:
            self.check(sequence.prompt, sequence.max_tokens)
        if len(sequences) > self.slots + self.queue_limit:
            raise ServingError(
                f"{len(sequences)} sequences in one request (prompts x n), more than this server ever holds "
                f"({self.slots} slots and a queue of {self.queue_limit}); ask for fewer"
            )
        with self._wake:
            if self._stopping:
                raise ServerFull("the server is stopping")
            gone = [s for s in self.waiting if s.cancelled.is_set()]
            if gone:
                self.waiting = collections.deque(s for s in self.waiting if not s.cancelled.is_set())
            # The free slots take waiting sequences first; past them, the queue.
            room = self.queue_limit + self.slots - self.count
            full = len(self.waiting) + len(sequences) > room
            if not full:
                self.waiting.extend(sequences)
                self._wake.notify()
            busy, waiting = self.count, len(self.waiting)
        for sequence in gone:
            sequence.finish("cancelled")
        if full:
            raise ServerFull(
                f"{busy} of {self.slots} slots busy and {waiting} sequences waiting (a queue of {self.queue_limit})"
            )

    def load(self) -> dict[str, int]:
        with self._wake:
            return {
                "slots": self.slots,
                "busy": self.count,
                "waiting": len(self.waiting),
                "queue_limit": self.queue_limit,
            }

    def programs(self) -> int:
        """How many programs the engine compiles, before its first request and after."""
        return self.compiled.count()

    def first_programs(self) -> int:
        """How many programs ``warm`` compiles before it returns: those that serve any request."""
        return len(self._covering())

    def _covering(self) -> set[tuple]:
        """The programs that serve any request: the decode call over every slot and the whole
        context, the prefill of the longest prompt, and the move where there are slots to move
        between."""
        return {("decode", self.slots, self.window), ("prefill", self.window)} | (
            {("move",)} if self.slots > 1 else set()
        )

    def warm(self, compiled: Callable[[int], None] = lambda done: None, every: bool = False) -> float:
        """Compiles the programs that serve any request before the first (call before
        ``start``): the decode call over every slot and the whole context, the prefill of the
        longest prompt, and the move; tells ``compiled`` how many are done after each and
        returns the seconds it took. The faster ones for fewer slots, shorter parts and shorter
        prompts then compile on threads while the engine serves, each used once it is
        (``wait_compiled``); with ``every``, before this returns. The programs are traced one
        after another and compiled, each run once as soon as it is (its jitted function finds
        it compiled) while the next compile, on ``compile_workers`` threads."""
        started = time.perf_counter()
        self._ready = frozenset()
        covering, faster = self._plan()
        first = covering + faster if every else covering
        pool = ThreadPoolExecutor(compile_workers(len(first), one_on_cpu=True), "bardflow-compile")
        try:
            first_runs = {pool.submit(lower().compile): (key, run) for key, lower, run in first}
            for done, finished in enumerate(as_completed(first_runs), 1):
                finished.result()
                key, run = first_runs[finished]
                run()
                self._mark_ready(key)
                compiled(done)
        finally:  # Ctrl-C waits for the compiles under way (XLA's cannot be stopped), not the rest
            pool.shutdown(cancel_futures=True)
        jax.block_until_ready((self.caches, self.tokens, self.keys))
        if not every:
            self._later = LaterCompiles(faster, self._mark_ready)
        return time.perf_counter() - started

    @property
    def stopping(self) -> bool:
        return self._stopping

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits until every program is compiled; whether they are."""
        return self._later is None or self._later.done.wait(timeout)

    def _mark_ready(self, key: tuple) -> None:
        with self._marking:  # one assignment: the engine's thread reads either set whole
            self._ready = (self._ready or frozenset()) | {key}

    def _plan(self) -> tuple[list[Program], list[Program]]:
        """The programs, as (key, its lowering, its first run): those that serve any request,
        then the faster ones for fewer slots, shorter parts and shorter prompts. The latter are
        lowered from the shapes of the engine's arrays as they are now, so that lowering on
        another thread reads none the engine's thread may since have given to a call."""
        inputs = self._call_inputs({})
        shapes = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), (self.caches, self.tokens, self.keys)
        )
        caches, tokens, keys = shapes

        def decode(size: int, fill: int) -> None:
            _, self.tokens, self.keys, self.caches = self._decode(
                self.params, self.caches, size, fill, self.tokens, self.keys, *inputs
            )

        def prefill(*prompt) -> None:
            self.caches, self.tokens, self.keys = self._prefill(
                self.params, self.caches, self.tokens, self.keys, *prompt
            )

        def move(*slots) -> None:
            self.caches, self.tokens, self.keys = self._move(self.caches, self.tokens, self.keys, *slots)

        def precise(lower: Callable[..., jax.stages.Lowered], *args) -> Callable[[], jax.stages.Lowered]:
            def lowered() -> jax.stages.Lowered:
                with jax.default_matmul_precision(self.precision):  # as ``matmul_precision`` runs them
                    return lower(*args)

            return lowered

        programs: list[Program] = []
        for size in decode_sizes(self.slots):
            for fill in fills(self.window):
                lower = precise(self._decode_jit.lower, self.params, caches, size, fill, tokens, keys, *inputs)
                programs.append((("decode", size, fill), lower, functools.partial(decode, size, fill)))
        for size in buckets(self.window):
            # Slot 0, this length, its bytes, its real length, seed, settings.
            prompt = (np.int32(0), size, np.zeros(size, np.int32), np.int32(1), np.int32(0), self.settings[0])
            lower = precise(self._prefill_jit.lower, self.params, caches, tokens, keys, *prompt)
            programs.append((("prefill", size), lower, functools.partial(prefill, *prompt)))
        if self.slots > 1:
            slots = (np.int32(1), np.int32(0))
            lower = functools.partial(self._move.lower, caches, tokens, keys, *slots)
            programs.append((("move",), lower, functools.partial(move, *slots)))
        covering = self._covering()
        return [p for p in programs if p[0] in covering], [p for p in programs if p[0] not in covering]

    # --- the engine's thread ---

    def _run(self) -> None:
        """Each round: free slots take waiting sequences, the next decode call is sent, and
        then the bytes of the call sent the round before are read and handed on, while the
        device runs this round's: the device waits for no reading. So a sequence that ends
        before its length (a stop, its client gone) runs one call past its end (those bytes
        are dropped) before it leaves its slot."""
        sent: tuple[jax.Array, list[Sequence | None], list[int]] | None = None
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self.waiting and not self.count and sent is None:
                        self._wake.wait()
                    if self._stopping:
                        break
                prefilled = self._admit()
                firsts = self.tokens  # with the first byte of each sequence just prefilled
                if prefilled:
                    firsts.copy_to_host_async()
                # No call once every sequence in flight has all its bytes drawn (the end of a burst).
                wanted = bool(self.feeding) or any(
                    s.max_tokens > s.drawn + s.unread for s in self.active[: self.count] if s
                )
                last, sent = sent, self._send() if wanted else None
                if last is not None:
                    self._read(*last)
                if prefilled:
                    first = np.asarray(firsts)
                    for slot, sequence in prefilled:
                        sequence.unread -= 1
                        self._hand_on(sequence, first[slot : slot + 1])
        finally:
            for slot in reversed(range(self.count)):
                self._leave(slot, "cancelled")
            with self._wake:
                left, self.waiting = list(self.waiting), collections.deque()
            for sequence in left:
                sequence.finish("cancelled")

    def _admit(self) -> list[tuple[int, Sequence]]:
        """Free slots take waiting sequences. A prompt of up to ``STEPS_A_CALL`` bytes is fed to
        the next decode call as its slot's first inputs (as the sampler feeds a prompt, a byte
        a step): every such sequence joins at once. A longer one is prefilled, one between
        decode calls while others decode (a long queue does not stall the streams in flight),
        as many as there are free slots when none does; (slot, sequence) of each prefilled."""
        prefilled, busy = [], self.count > 0
        while self.count < self.slots:
            with self._wake:
                sequence = self.waiting.popleft() if self.waiting else None
            if sequence is None:
                break
            if sequence.cancelled.is_set():
                sequence.finish("cancelled")
                continue
            if len(sequence.prompt) <= STEPS_A_CALL:
                self._join_fed(self.count, sequence)
                continue
            if busy and prefilled:
                with self._wake:
                    self.waiting.appendleft(sequence)
                break
            prefilled.append((self.count, sequence))
            self._join(self.count, sequence)
        return prefilled

    def _seat(self, slot: int, sequence: Sequence, position: int, unread: int) -> None:
        """The sequence in the slot, at ``position``."""
        s = sequence.sampling
        self.active[slot], sequence.slot, sequence.unread = sequence, slot, unread
        self.count += 1
        self.positions[slot], self.settings[slot] = position, (s.temperature, s.top_k, s.top_p)

    def _join_fed(self, slot: int, sequence: Sequence) -> None:
        self._seat(slot, sequence, 0, 0)
        self.feeding[slot] = (sequence.prompt, sequence.sampling.seed)

    def _join(self, slot: int, sequence: Sequence) -> None:
        ready = self._ready
        size = min(
            b for b in buckets(self.window) if b >= len(sequence.prompt) and (ready is None or ("prefill", b) in ready)
        )
        prompt = np.zeros(size, np.int32)
        prompt[: len(sequence.prompt)] = as_ids(sequence.prompt)
        self._seat(slot, sequence, len(sequence.prompt), 1)
        self.caches, self.tokens, self.keys = self._prefill(
            self.params,
            self.caches,
            self.tokens,
            self.keys,
            np.int32(slot),
            size,
            prompt,
            np.int32(len(sequence.prompt)),
            np.int32(sequence.sampling.seed),
            self.settings[slot].copy(),
        )

    def _send(self) -> tuple[jax.Array, list[Sequence | None], list[int]]:
        """Sends one decode call of ``STEPS_A_CALL`` steps over the slots in flight: its bytes
        (on their way to the host), the sequence in each of its slots, and the first step
        whose byte each keeps."""
        # The last position the call writes, past which no query reads (a rotary ring past
        # the context reads all of it).
        furthest = min(int(self.positions[: self.count].max()) + STEPS_A_CALL, self.window)
        # The fewest slots, then the shortest part, of the programs compiled so far.
        ready = self._ready
        size, fill = min(
            (size, fill)
            for size in decode_sizes(self.slots)
            for fill in fills(self.window)
            if size >= self.count and fill >= furthest and (ready is None or ("decode", size, fill) in ready)
        )
        positions, settings, fed, kept_from, fed_seeds = self._call_inputs(self.feeding)
        drawn, self.tokens, self.keys, self.caches = self._decode(
            self.params, self.caches, size, fill, self.tokens, self.keys, positions, settings, fed, kept_from, fed_seeds
        )
        drawn.copy_to_host_async()
        self.feeding = {}
        self.positions[: self.count] += STEPS_A_CALL
        for sequence, first in zip(self.active[: self.count], kept_from.tolist(), strict=False):
            assert sequence is not None
            sequence.unread += STEPS_A_CALL - first
        return drawn, self.active[:size], kept_from[:size].tolist()

    def _call_inputs(self, feeding: dict[int, tuple[bytes | list[int], int]]) -> tuple[np.ndarray, ...]:
        """A decode call's inputs from the host: positions, settings, the fed prompts' bytes,
        the first step whose byte each slot keeps, and the fed prompts' seeds. Copies: the call
        may read them after it is sent (a CPU reads host memory where it lies), and the
        engine's own change before then."""
        fed = np.full((self.slots, STEPS_A_CALL), -1, np.int32)
        kept_from = np.zeros(self.slots, np.int32)
        fed_seeds = np.zeros(self.slots, np.int32)
        for slot, (prompt, seed) in feeding.items():
            fed[slot, : len(prompt)] = as_ids(prompt)
            kept_from[slot] = len(prompt) - 1  # the prompt's last byte is the first kept byte's input
            fed_seeds[slot] = seed
        return self.positions.copy(), self.settings.copy(), fed, kept_from, fed_seeds

    def _read(self, drawn: jax.Array, served: list[Sequence | None], kept_from: list[int]) -> None:
        """A call's bytes handed on to the sequences it served that have not ended since."""
        steps = np.asarray(drawn)
        # Highest first: of the sequences that end together, those on top leave without a move.
        for column in reversed(range(len(served))):
            sequence = served[column]
            if sequence is not None:
                sequence.unread -= STEPS_A_CALL - kept_from[column]
                if sequence.slot is not None:
                    self._hand_on(sequence, steps[kept_from[column] :, column])

    def _hand_on(self, sequence: Sequence, ids: np.ndarray) -> None:
        """A sequence's new tokens: their bytes handed on as far as no stop sequence may still
        be starting, and the sequence ended where a stop sequence, its length, or its client's
        leaving says."""
        assert sequence.slot is not None
        if sequence.cancelled.is_set():
            self._leave(sequence.slot, "cancelled")
            return
        if sequence.first_byte_s is None:
            sequence.first_byte_s = time.perf_counter() - sequence.queued_at
        for index in ids[: sequence.max_tokens - sequence.drawn].tolist():
            sequence.generated += self.vocabulary.pieces[index]
            sequence.drawn_ids.append(index)
            sequence.token_ends.append(len(sequence.generated))
        # A stop can only start in the bytes not handed on yet (any that might start one are
        # held back): the search reads those, not the whole sequence again. The first stop to
        # complete ends the sequence, where it starts.
        tail = bytes(sequence.generated[sequence.sent :])
        found = [(at + len(stop), at) for stop in sequence.stop if (at := tail.find(stop)) >= 0]
        if found:
            del sequence.generated[sequence.sent + min(found)[1] :]
            self._send_bytes(sequence, len(sequence.generated))
            self._leave(sequence.slot, "stop")
            return
        if sequence.drawn >= sequence.max_tokens:
            self._send_bytes(sequence, len(sequence.generated))
            self._leave(sequence.slot, "length")
            return
        held = max((_partial_stop(tail, stop) for stop in sequence.stop), default=0)
        self._send_bytes(sequence, len(sequence.generated) - held)

    def _send_bytes(self, sequence: Sequence, upto: int) -> None:
        if upto > sequence.sent:
            sequence.emit(bytes(sequence.generated[sequence.sent : upto]))
            sequence.sent = upto

    def _leave(self, slot: int, reason: str) -> None:
        """The slot's sequence ends; the highest slot in flight moves into its place."""
        sequence, last = self.active[slot], self.count - 1
        if slot != last:
            self.caches, self.tokens, self.keys = self._move(
                self.caches, self.tokens, self.keys, np.int32(last), np.int32(slot)
            )
            moved = self.active[slot] = self.active[last]
            assert moved is not None
            moved.slot = slot
            self.positions[slot], self.settings[slot] = self.positions[last], self.settings[last]
        self.active[last] = None
        self.positions[last], self.settings[last] = 0, WHOLE
        self.count -= 1
        if sequence is not None:
            sequence.slot = None
            sequence.finish(reason)


def _partial_stop(text: bytes, stop: bytes) -> int:
    """How many of ``text``'s last bytes are the start of ``stop`` (held back until they are
    known not to be one)."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0
