"""The shapes the serving engine's programs are compiled for (``serving/engine.py``): the
prefill lengths (a prompt rounded up to a power of two), the parts of a slot's cache a decode
call reads (as far as it is filled, not the whole context), and the slot counts a decode call
runs over (one stream is not charged for 63 idle slots). A program per combination, all
compiled before the first request, none after."""

from __future__ import annotations

MIN_BUCKET = 16  # the shortest prefill: shorter prompts share its program
# Parts shorter than a quarter of the context stop here: each is one more program per decode
# size, and with positions along the last axis (a TPU) a shorter part still reads a whole row
# of 128 lanes.
SHORTEST_FILL = 128


def buckets(window: int) -> list[int]:
    """The prefill lengths: powers of two from ``MIN_BUCKET`` up to the context, and the context."""
    sizes, size = [], MIN_BUCKET
    while size < window:
        sizes.append(size)
        size *= 2
    return [*sizes, window]


def fills(window: int) -> list[int]:
    """The parts of a slot's cache a decode call reads: its first quarter, half, or all of it
    (all of it where the context does not split in four), and shorter halvings down to
    ``SHORTEST_FILL`` positions (``gpt2``'s 1,024: 128, 256, 512 or 1,024)."""
    if window % 4:
        return [window]
    parts = [window // 4, window // 2, window]
    # Halved only into whole 16-position tiles, as the decode kernels store a bfloat16 cache.
    while parts[0] % 32 == 0 and parts[0] // 2 >= SHORTEST_FILL:
        parts.insert(0, parts[0] // 2)
    return parts


def decode_sizes(slots: int) -> list[int]:
    """The slot counts a decode call is compiled for: 2, 4 and 8 (below ``slots``), and all
    ``slots``; the call cuts its slots' filled part out of the cache and puts it back.
    Cutting out more costs more in copies than the idle slots' arithmetic (measured on a CPU:
    docs/journal.md); one slot alone takes two, where XLA:CPU compiles a faster step."""
    return [size for size in (2, 4, 8) if size < slots] + [slots]
