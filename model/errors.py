"""The one family of errors that bardflow explains.

An error of this family names the problem and the fix in its message: the command line
shows it as one ``bardflow: error: ...`` line (a traceback only with ``--debug``) and the
run's log keeps it without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class BardflowError(Exception):
    """An explained error: its message says what is wrong and what to do."""
