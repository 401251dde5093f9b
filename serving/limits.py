"""``bardflow serve``'s settings in one record: their defaults and ranges, which the command
line, the HTTP API and the engine all read, and the error for what falls outside them. Light
to import: the command line checks its words with it before JAX or uvicorn load."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..errors import BardflowError


class ServingError(BardflowError, ValueError):
    """A request the server cannot take as it is; the message names the field and the limit."""


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # this machine only
WILDCARDS = ("0.0.0.0", "::", "")  # every address of the machine


@dataclass(frozen=True)
class ServeSettings:
    """Where and how much: the address, the slots decoded together, the requests that may wait
    for a slot (then 503), the most bytes one sequence may ask for, whether the decode step
    runs the Pallas TPU kernels (``Engine(kernels=...)``), and the cache's type (None: the
    weights')."""

    host: str = LOCAL_HOSTS[0]
    port: int = field(default=8000, metadata={"range": (1, 65535)})
    slots: int = field(default=8, metadata={"range": (1, 1024)})
    queue: int = field(default=64, metadata={"range": (0, 100_000)})
    max_tokens: int = field(default=4096, metadata={"range": (1, 1_000_000)})
    kernels: bool = False
    cache: str | None = None
    api_key: str | None = None  # what requests must send as Authorization: Bearer KEY; None: none
    allowed_hosts: tuple[str, ...] = ()  # host names requests may address besides these and loopback's

    def hosts(self) -> tuple[str, ...]:
        """The names a request's ``Host`` may give: the bound address (not a wildcard) and those allowed."""
        return (*(() if self.host in WILDCARDS else (self.host,)), *self.allowed_hosts)

    def out_of_range(self) -> str | None:
        """The first number outside its range, as ``--name must be LOW to HIGH``; None if all fit."""
        for setting in fields(self):
            low_high = setting.metadata.get("range")
            if low_high and not low_high[0] <= getattr(self, setting.name) <= low_high[1]:
                return f"--{setting.name.replace('_', '-')} must be {low_high[0]} to {low_high[1]}"
        return None
