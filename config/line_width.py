"""How a line of bardflow's meets the user's terminal: broken at spaces to its width, so that
no word and no link is cut in two (a terminal breaks a long line wherever its width ends);
elsewhere (a log file, a pipe, a test) one line stays one line."""

from __future__ import annotations

import shutil
import sys
import textwrap
from typing import TextIO


def fit(text: str, stream: TextIO | None = None) -> str:
    """``text`` for ``stream`` (stderr by default): each line longer than a terminal's width
    broken at spaces, a word longer than a line (a link) on a line of its own, whole."""
    stream = stream if stream is not None else sys.stderr
    try:
        on_terminal = stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # closed, or no file behind it
        on_terminal = False
    if not on_terminal:
        return text
    width = shutil.get_terminal_size().columns
    return "\n".join(
        textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False) if len(line) > width else line
        for line in text.split("\n")
    )
