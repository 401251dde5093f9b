"""The ``bardflow`` command line: its arguments, what it prints, and the runs it reads."""
