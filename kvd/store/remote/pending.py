"""`Pending`: a remote answer is on its way, so the request asks again later.

The daemon's serving thread never waits for the remote tier (the package's
docstring, "Off the serving thread"). When a LOOKUP or GET needs the server,
`WithRemote` hands the round trip to a reader thread and raises `Pending`;
the handler parks the request (kvd/server/parking.py, as a write-through PUT
is parked) and serves it again, from the start, once the answer is in.
This module imports nothing, so the handler can catch the exception without
loading the tier.
"""

from __future__ import annotations

from typing import Any


class Pending(Exception):
    """Raised by a remote-backed store in its deferring mode: `fut` (a
    concurrent.futures.Future) carries the answer the request waits for."""

    def __init__(self, fut: Any):
        super().__init__("a remote answer is on its way")
        self.fut = fut
