"""The remote tier's layout: keys and self-describing values (sans-I/O).

A daemon with `remote_url` copies its entries to a Redis/Valkey server that
several daemons share (kvd/store/remote.py does the I/O). This module only
turns an entry into key/value bytes and back, so it is tested byte for byte
against proto/vectors/remote/ and fuzzed like the wire codec. The layout is
specified in proto/PROTOCOL.md section 13; in short:

    key     kvd:1:<hex chain key>          a chunk
            kvd:1:<hex chain key>:b        the boundary state at its end
            <key>:p<i>                     part i >= 1 of a value over the part size
            kvd:1:<hex parent key>:tails   hash: hex tail key -> tail length

    value   "KVR1" | u64 xxh3 | u32 H | header (msgpack, H bytes) | payload part 0

The checksum is xxh3-64 over the header bytes then the whole payload (every
part in order), so a flipped bit anywhere -- header, part, or a part missing
or of the wrong length -- fails `decode`, and a value copied under another
key fails its key check: a bad value is a miss, never a wrong byte.

Rules:
1. `decode` raises BadRemoteValue for any bytes that are not exactly the
   entry the key names; it never raises anything else, whatever the input.
2. Tensors are views into the values' bytes (no copy); only a tensor that
   straddles two parts is joined.
3. A header bounds what reading the rest costs before any of it is asked
   for: `read_head` refuses a `size` over the reader's largest entry and more
   than MAX_PARTS parts, and `Head.part_lengths` gives each part's exact
   length, so a reply of any other length is refused from its length alone.
   A writer raises its part size when an entry would need more parts.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import xxhash

from kvd.protocol import dtypes
from kvd.protocol.codec import Tensor
from kvd.protocol.errors import KvdError

VERSION = 1
MAGIC = b"KVR1"
PREFIX = b"kvd:1:"
_FIXED = struct.Struct("<4sQI")  # magic, checksum, header length
MAX_HEADER_BYTES = 1 << 20  # a header is a few hundred bytes; meta is small
MAX_TENSORS = 4096
MAX_RANK = 8
MAX_PARTS = 1024  # parts of one value: 512 MiB in the smallest part size (1 MiB) needs 512
KINDS = (0, 1)  # CHUNK, BOUNDARY (kvd.store.base)


class BadRemoteValue(KvdError):
    """A remote-tier value that is not the entry its key names (corrupt,
    truncated, a part missing, or written by a kvd that uses another layout)."""


@dataclass(slots=True)
class RemoteEntry:
    """What a value carries: an entry's fields (kvd.store.base.Entry) without the store."""

    namespace: str
    key: bytes
    kind: int
    parent: bytes
    start: int
    length: int
    tensors: tuple[Tensor, ...]
    meta: bytes = b""
    tail: bool = False


def value_key(key: bytes, kind: int) -> bytes:
    """The remote key of an entry: kvd:1:<hex chain key>, with ":b" for boundary state."""
    return PREFIX + key.hex().encode() + (b":b" if kind == 1 else b"")


def part_key(main: bytes, i: int) -> bytes:
    """The key of part `i` (1-based past the main value) of a split value."""
    return main + b":p%d" % i


def tails_key(parent: bytes) -> bytes:
    """The hash listing the tail chunks stored under `parent` (field: hex key, value: length)."""
    return PREFIX + parent.hex().encode() + b":tails"


def encode(entry: RemoteEntry, part_bytes: int) -> list[bytes]:
    """The values of `entry`: [main value, part 1, part 2, ...], each holding
    at most `part_bytes` of payload (the main value also holds the header);
    more if the entry would otherwise need over MAX_PARTS parts."""
    if part_bytes < 1:
        raise ValueError("part_bytes must be >= 1")
    size = sum(t.nbytes for t in entry.tensors)
    part_bytes = max(part_bytes, -(-size // MAX_PARTS))  # readers refuse more than MAX_PARTS parts
    parts = max(1, -(-size // part_bytes))
    header = msgpack.packb({
        "v": VERSION, "ns": entry.namespace, "key": entry.key, "kind": entry.kind, "parent": entry.parent,
        "start": entry.start, "length": entry.length, "tail": entry.tail, "meta": entry.meta,
        "tensors": [[t.name, t.dtype, list(t.shape)] for t in entry.tensors],
        "size": size, "parts": parts, "part_bytes": part_bytes,
    }, use_bin_type=True)
    payload = b"".join(memoryview(t.data).cast("B") for t in entry.tensors)
    h = xxhash.xxh3_64(header)
    h.update(payload)
    first = _FIXED.pack(MAGIC, h.intdigest(), len(header)) + header + payload[:part_bytes]
    return [first] + [payload[i * part_bytes : (i + 1) * part_bytes] for i in range(1, parts)]


@dataclass(slots=True)
class Head:
    """A main value's header, read before its parts are fetched."""

    fields: dict[str, Any]
    checksum: int
    header: bytes
    body: memoryview  # payload part 0

    @property
    def parts(self) -> int:
        return self.fields["parts"]

    @property
    def size(self) -> int:
        return self.fields["size"]

    def part_lengths(self) -> list[int]:
        """The exact length of each part 1.. the header promises (part 0 is in the main value)."""
        size, pb = self.fields["size"], self.fields["part_bytes"]
        return [min(pb, size - i * pb) for i in range(1, self.fields["parts"])]


def max_main_bytes(max_size: int) -> int:
    """The longest main value an entry of at most `max_size` payload bytes can have."""
    return _FIXED.size + MAX_HEADER_BYTES + max_size


def read_head(value: bytes | memoryview, max_size: int | None = None) -> Head:
    """The header of a main value (so the caller knows how many parts to
    fetch, and each one's length). Raises BadRemoteValue, also for a payload
    over `max_size` bytes (the largest entry the reader takes)."""
    view = memoryview(value).cast("B")
    if len(view) < _FIXED.size:
        raise BadRemoteValue(f"value of {len(view)} bytes is shorter than its fixed prefix")
    magic, checksum, hlen = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise BadRemoteValue(f"magic {bytes(magic)!r} is not {MAGIC!r}")
    if hlen > MAX_HEADER_BYTES or _FIXED.size + hlen > len(view):
        raise BadRemoteValue(f"header length {hlen} does not fit a value of {len(view)} bytes")
    header = bytes(view[_FIXED.size : _FIXED.size + hlen])
    try:
        fields = msgpack.unpackb(header, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises several types for garbage
        raise BadRemoteValue(f"header is not msgpack: {exc}") from None
    _check_fields(fields)
    if max_size is not None and fields["size"] > max_size:
        raise BadRemoteValue(f"header: size {fields['size']} is over the largest entry taken here ({max_size})")
    return Head(fields, checksum, header, view[_FIXED.size + hlen :])


def _check_fields(f: Any) -> None:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise BadRemoteValue(f"header: {what}")

    need(isinstance(f, dict), "not a map")
    need(f.get("v") == VERSION, f"version {f.get('v')!r} is not {VERSION}")
    for name, kind in (("ns", str), ("key", bytes), ("parent", bytes), ("meta", bytes), ("tensors", list)):
        need(isinstance(f.get(name), kind), f"{name} missing or of the wrong type")
    for name in ("kind", "start", "length", "size", "parts", "part_bytes"):
        need(type(f.get(name)) is int and f[name] >= 0, f"{name} missing or not a natural number")
    need(isinstance(f.get("tail"), bool), "tail missing or not a boolean")
    need(len(f["key"]) == 32 and len(f["parent"]) == 32, "key and parent must be 32 bytes")
    need(f["kind"] in KINDS, f"kind {f['kind']} unknown")
    need(f["part_bytes"] >= 1 and f["parts"] == max(1, -(-f["size"] // f["part_bytes"])), "parts do not match size")
    need(f["parts"] <= MAX_PARTS, f"{f['parts']} parts is over {MAX_PARTS}")
    need(len(f["tensors"]) <= MAX_TENSORS, "too many tensors")
    total = 0
    for t in f["tensors"]:
        need(isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and isinstance(t[1], str)
             and isinstance(t[2], list), "tensor descriptor is not [name, dtype, shape]")
        need(t[1] in dtypes.DTYPES, f"dtype {t[1]!r} unknown")
        need(len(t[2]) <= MAX_RANK and all(type(d) is int and d >= 0 for d in t[2]), "bad shape")
        n = dtypes.itemsize(t[1])
        for d in t[2]:
            n *= d
        total += n
    need(total == f["size"], f"tensors hold {total} bytes, header says {f['size']}")


def decode(head: Head, parts: Sequence[bytes | memoryview | None], *, key: bytes, kind: int) -> RemoteEntry:
    """The entry of a main value (`head`) and its parts 1.. (None: missing).

    Raises BadRemoteValue unless the value is exactly the entry `key`/`kind` names.
    """
    f = head.fields
    if f["key"] != key or f["kind"] != kind:
        raise BadRemoteValue("value names another entry than its key")
    if len(parts) != f["parts"] - 1:
        raise BadRemoteValue(f"{len(parts)} parts given, header says {f['parts'] - 1}")
    size, pb = f["size"], f["part_bytes"]
    views = [head.body]
    for p in parts:
        if p is None:
            raise BadRemoteValue("a part is missing (evicted)")
        views.append(memoryview(p).cast("B"))
    for i, v in enumerate(views):
        want = min(pb, size - i * pb) if size else 0
        if len(v) != want:
            raise BadRemoteValue(f"part {i} holds {len(v)} bytes, expected {want}")
    h = xxhash.xxh3_64(head.header)
    for v in views:
        h.update(v)
    if h.intdigest() != head.checksum:
        raise BadRemoteValue("checksum mismatch")
    tensors, off = [], 0
    for name, dtype, shape in f["tensors"]:
        n = dtypes.itemsize(dtype)
        for d in shape:
            n *= d
        first, last = off // pb, max(off, off + n - 1) // pb
        if first == last:  # inside one part: a view, no copy
            data = views[first][off - first * pb : off - first * pb + n]
        else:  # straddles parts: join just this tensor's pieces
            data = memoryview(b"".join(
                views[i][max(off, i * pb) - i * pb : min(off + n, (i + 1) * pb) - i * pb] for i in range(first, last + 1)
            ))
        tensors.append(Tensor(name, dtype, tuple(shape), data))
        off += n
    return RemoteEntry(
        namespace=f["ns"], key=f["key"], kind=f["kind"], parent=f["parent"], start=f["start"],
        length=f["length"], tensors=tuple(tensors), meta=f["meta"], tail=f["tail"],
    )
