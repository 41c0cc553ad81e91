"""A big header's top-level map, read without copying its token bytes. Sans I/O.

msgpack-python turns every bin into a new `bytes`: a LOOKUP of a million
tokens is a 4 MiB copy (and a fresh 4 MiB allocation) before any rule can
look at it, though the daemon walks at most `max_chunks` chunks of it (32 KiB
with `chunk_tokens=1`). On a busy machine that copy took the serving thread
~3.6 ms per request (issue 12's heavy peers). So a header of `SKIM_BYTES` or
more is read one top-level entry at a time: the `tokens` bin becomes a
memoryview into the received frame, every other key and value is decoded by
msgpack itself (an `Unpacker` over that slice of the frame, sharing one
object budget), and the result is the map `msgpack.unpackb` would have
returned -- or None when the header is not a map of at most `MAX_KEYS`
entries, and then the caller decodes it whole, as before.

A `chunks` array of more than `LAZY_ITEMS` items is not decoded either: it
is skipped over (msgpack's parser, no objects made: ~0.1 us an item against
~3 us to decode one) and becomes `Items`, which decodes its items when
asked, a few at a time. A PUT of 8,000 tiny chunks was 23 ms of one msgpack
call before any rule could look at it; its handler now decodes its chunks
in turns (kvd.protocol.codec.LazyChunks, issue 44).
"""

from __future__ import annotations

from typing import Any, Callable

import msgpack

SKIM_BYTES = 64 << 10  # smaller headers are decoded whole: nothing big to spare
MAX_KEYS = 64  # a header with more top-level keys is nobody's request: decoded whole
ZERO_COPY = "tokens"  # the one field whose bin stays in the frame
READ_BYTES = 4 << 10  # bytes an Unpacker copies out of the frame at a time (most values are tiny)
LAZY = "chunks"  # the one field whose items may be decoded later (Items)
LAZY_ITEMS = 256  # ... when it has more than this many


class _Slices:
    """A file-like view of `view[pos:]` for msgpack.Unpacker (it copies what it reads)."""

    __slots__ = ("view", "pos")

    def __init__(self, view: memoryview, pos: int):
        self.view, self.pos = view, pos

    def read(self, n: int) -> bytes:
        out = bytes(self.view[self.pos : self.pos + n])
        self.pos += len(out)
        return out


def top_level(view: memoryview, unpacker_args: dict[str, Any], count: Callable[[Any], Any]) -> dict | None:
    """The header in `view` as a dict, its `tokens` bin (if any) a memoryview
    of `view`; None if it is not a map of at most MAX_KEYS entries. Raises
    what msgpack raises for bytes it would reject (ValueError, OutOfData,
    ...). `unpacker_args` are msgpack's limits and hooks; `count` is the
    object hook (called once here for the top-level map)."""
    size, pos = _map_header(view)
    if size is None or size > MAX_KEYS:
        return None
    out: dict = {}
    for _ in range(size):
        key, pos = _one(view, pos, unpacker_args)
        if not isinstance(key, (str, bytes)):  # what strict_map_key=True allows
            raise ValueError(f"{type(key).__name__} is not allowed for map key")
        if key == ZERO_COPY and pos < len(view) and view[pos] in _BIN_WIDTH:
            out[key], pos = _bin(view, pos)
        elif key == LAZY and (items := _items(view, pos, unpacker_args)) is not None:
            out[key], pos = items, items.end
        else:
            out[key], pos = _one(view, pos, unpacker_args)
    if pos != len(view):
        raise msgpack.ExtraData(out, b"")
    return count(out)


class Items:
    """An array's items, still msgpack in the header: `count` of them from
    byte `start` of `view` to `end`. Decoded by `unpacker()` one at a time
    (under the header's limits and object budget), or all at once by `all()`."""

    __slots__ = ("view", "start", "end", "count", "_args")

    def __init__(self, view: memoryview, start: int, end: int, count: int, args: dict[str, Any]):
        self.view, self.start, self.end, self.count, self._args = view, start, end, count, args

    def __len__(self) -> int:
        return self.count

    def unpacker(self) -> msgpack.Unpacker:
        """An Unpacker whose next `count` objects are the items."""
        return msgpack.Unpacker(_Slices(self.view[: self.end], self.start), read_size=READ_BYTES, **self._args)

    def all(self) -> list:
        """Every item, decoded: the array msgpack would have returned."""
        unpacker = self.unpacker()
        return [unpacker.unpack() for _ in range(self.count)]


def _items(view: memoryview, pos: int, unpacker_args: dict[str, Any]) -> Items | None:
    """The array at `pos` as Items if it has more than LAZY_ITEMS, else None.
    Raises what msgpack raises for items it would reject."""
    first = view[pos] if pos < len(view) else None
    if first == 0xDC and pos + 3 <= len(view):
        count, start = int.from_bytes(view[pos + 1 : pos + 3], "big"), pos + 3
    elif first == 0xDD and pos + 5 <= len(view):
        count, start = int.from_bytes(view[pos + 1 : pos + 5], "big"), pos + 5
    else:
        return None  # a fixarray (15 items at most), or not an array
    if count <= LAZY_ITEMS:
        return None
    if count > unpacker_args.get("max_array_len", count):
        raise ValueError(f"{count} exceeds max_array_len")
    unpacker = msgpack.Unpacker(_Slices(view, start), read_size=READ_BYTES, **unpacker_args)
    for _ in range(count):
        unpacker.skip()
    hook = unpacker_args.get("list_hook")
    if hook is not None:
        hook(range(count))  # the array itself, charged to the header's budget as msgpack would when it ends
    return Items(view, start, start + unpacker.tell(), count, unpacker_args)


_BIN_WIDTH = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # bin 8/16/32: bytes of the length that follows


def _map_header(view: memoryview) -> tuple[int | None, int]:
    first = view[0] if len(view) else None
    if first is not None and 0x80 <= first <= 0x8F:
        return first & 0x0F, 1
    if first == 0xDE and len(view) >= 3:
        return int.from_bytes(view[1:3], "big"), 3
    if first == 0xDF and len(view) >= 5:
        return int.from_bytes(view[1:5], "big"), 5
    return None, 0


def _bin(view: memoryview, pos: int) -> tuple[memoryview, int]:
    width = _BIN_WIDTH[view[pos]]
    start = pos + 1 + width
    if start > len(view):
        raise msgpack.OutOfData("bin length cut short")
    end = start + int.from_bytes(view[pos + 1 : start], "big")
    if end > len(view):
        raise msgpack.OutOfData("bin cut short")
    return view[start:end], end


_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}


def _one(view: memoryview, pos: int, unpacker_args: dict[str, Any]) -> tuple[Any, int]:
    """One msgpack object at `pos`; (object, where the next starts). Short
    strings and small ints (every key, most values) are read here; the rest
    by msgpack."""
    first = view[pos] if pos < len(view) else None
    if first is not None:
        if first < 0x80:  # positive fixint
            return first, pos + 1
        if 0xA0 <= first <= 0xBF:  # fixstr
            end = pos + 1 + (first & 0x1F)
            if end <= len(view):
                return str(view[pos + 1 : end], "utf-8"), end
        if first in _CONSTANTS:
            return _CONSTANTS[first], pos + 1
    unpacker = msgpack.Unpacker(_Slices(view, pos), read_size=READ_BYTES, **unpacker_args)
    obj = unpacker.unpack()
    return obj, pos + unpacker.tell()
