"""Requests of many frames decoded off the serving thread (issue 44).

Decoding checks every part of a message: a PUT of 8,000 tiny chunks is a
msgpack header of 8,000 maps (~15 ms to unpack here) and 8,000 tensors to
check against their frames (~30 ms), more on a busy machine. On the serving
thread that is ~45 ms every other client waits. A message of more than
`APART_FRAMES` frames is decoded on a thread of its own instead: the
decoder is pure (kvd.protocol.codec: no I/O, no shared state), and the
serving thread takes the GIL back within the interpreter's switch interval
(0.2 ms, kvd serve) whenever a request comes. Meanwhile the request waits
in turns (kvd/server/admission/turns.py rule 5) like one served in turns,
ahead of its peer's later requests; its decoded message is then served as
any other. One thread: a peer that sends many such messages waits for its
own.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvd.protocol import codec
from kvd.protocol.limits import Limits

# Frames (a tensor each, the header one more) past which a request is
# decoded apart: ~6 us a frame, so ~6 ms of the serving thread at most.
APART_FRAMES = 1024


class Decoder:
    """One thread that decodes requests (started at the first)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, frames: list[Any], limits: Limits) -> Future:
        """A future of `codec.decode_request(frames, limits)`: the Message, or its ProtocolError."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvd-decode")
        return self._pool.submit(codec.decode_request, frames, limits)
