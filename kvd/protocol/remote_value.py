"""The remote tier's layout: keys and authenticated values (sans-I/O).

A daemon with `remote_url` copies its entries to a Redis/Valkey server that
several daemons share (kvd/store/remote/ does the I/O). Anyone who can write
to that server can write any key, so a value is trusted only if it carries a
MAC made with the secret the daemons share (`remote_key_file`) -- a secret
never sent to the server. This module turns an entry into key/value bytes
and back, so it is tested byte for byte against proto/vectors/remote/ and
fuzzed like the wire codec. The layout is specified in proto/PROTOCOL.md
section 13; in short:

    key     kvd:2:{<hex chain key>}          a chunk
            kvd:2:{<hex chain key>}:b        the boundary state at its end
            <key>:p<i>                       part i >= 1 of a value over the part size
            kvd:2:{<hex parent key>}:tails   hash: hex tail key -> "<length>:<hex tag>"
            (the braces are a Redis Cluster hash tag: a chunk, its parts, its
            boundary and the tails hash of its children share one slot, so
            one node answers a read of one value; chunks spread over all nodes)

    value   "KVR2" | u32 H | key tag (16) | MAC (32) | header (msgpack, H bytes) | payload part 0

Three keys are derived from the shared secret with BLAKE3's key derivation
(`RemoteKey`), and each is used in BLAKE3's keyed mode:

    key tag   keyed(K_tag, main key name)[:16]: a trusted writer stored a value
              under this name. A LOOKUP reads just the first 24 bytes of a value
              (GETRANGE) to say "held"; a tag is bound to its key's name, so a
              tag copied to another key, or made up, fails.
    MAC       keyed(K_mac, u32 len | main key name | u32 H | header | payload):
              verified before any byte of the value is served or promoted. It
              covers the name, so a value copied under another key fails; the
              header, so a swapped header fails; every part in order, so a
              flipped, missing or reordered byte fails.
    tail tag  keyed(K_tail, tails key | field | length)[:16] beside each tail's
              length, so a planted tail is not offered to the matcher.

BLAKE3 (~4 GiB/s on one core here, releasing the GIL) replaces the xxh3
checksum of layout 1: a MAC is also the corruption check, and xxh3, which
anyone can compute, proves nothing about who wrote a value.

Rules:
1. `decode` raises BadRemoteValue for any bytes that are not exactly the
   entry the key names as a holder of the secret wrote it (ForgedRemoteValue
   when the tag or MAC is wrong); it never raises anything else, whatever the
   input.
2. Tensors are views into the values' bytes (no copy); only a tensor that
   straddles two parts is joined.
3. A header bounds what reading the rest costs before any of it is asked
   for: `read_head` refuses a `size` over the reader's largest entry and more
   than MAX_PARTS parts, and `Head.part_lengths` gives each part's exact
   length, so a reply of any other length is refused from its length alone.
   A writer raises its part size when an entry would need more parts.
4. Nothing about the secret reaches the server or a log: `RemoteKey.fingerprint`
   (a hash under its own derived key) is what operators compare.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

import blake3
import msgpack

from kvd.protocol import dtypes
from kvd.protocol.codec import Tensor
from kvd.protocol.errors import KvdError

VERSION = 2
MAGIC = b"KVR2"
PREFIX = b"kvd:2:"
TAG_BYTES = 16
MAC_BYTES = 32
SECRET_BYTES = 32
_FIXED = struct.Struct("<4sI16s32s")  # magic, header length, key tag, MAC
PRESENCE_BYTES = 4 + 4 + TAG_BYTES  # what a LOOKUP reads of a value: magic, header length, key tag
MAX_HEADER_BYTES = 1 << 20  # a header is a few hundred bytes; meta is small
MAX_TENSORS = 4096
MAX_RANK = 8
MAX_PARTS = 1024  # parts of one value: 512 MiB in the smallest part size (1 MiB) needs 512
KINDS = (0, 1)  # CHUNK, BOUNDARY (kvd.store.base)
_CONTEXT = "kvd remote tier layout 2 {}"  # BLAKE3 derive_key contexts: tag, mac, tail, id


class BadRemoteValue(KvdError):
    """A remote-tier value that is not the entry its key names (corrupt,
    truncated, a part missing, or written by a kvd that uses another layout)."""


class ForgedRemoteValue(BadRemoteValue):
    """A remote-tier value whose key tag or MAC is not the shared secret's: written
    by someone without the key (or with another key), or altered since."""


class RemoteKey:
    """The secret the daemons sharing a remote tier hold: 32 bytes, written as
    64 hex digits in `remote_key_file` (`kvd keys remote` makes one). The keys
    it derives sign and check values; none of them is ever sent anywhere."""

    __slots__ = ("_tag", "_mac", "_tail", "fingerprint")

    def __init__(self, secret: bytes):
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a remote key is {SECRET_BYTES} bytes, not {len(secret)}")
        self._tag, self._mac, self._tail, ident = (
            blake3.blake3(secret, derive_key_context=_CONTEXT.format(use)).digest() for use in ("tag", "mac", "tail", "id")
        )
        self.fingerprint = ident[:8].hex()  # names the key in logs and stats; reveals nothing of it

    @classmethod
    def from_text(cls, text: str) -> "RemoteKey":
        """The key written in a key file: 64 hex digits (surrounding whitespace
        ignored). Raises ValueError for anything else."""
        digits = text.strip()
        if len(digits) != 2 * SECRET_BYTES or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise ValueError(f"a remote key file holds {2 * SECRET_BYTES} hex digits and nothing else")
        return cls(bytes.fromhex(digits))

    def __repr__(self) -> str:
        return f"RemoteKey({self.fingerprint})"

    def key_tag(self, main: bytes) -> bytes:
        """The tag proving a holder of the secret wrote a value named `main`."""
        return blake3.blake3(main, key=self._tag).digest(TAG_BYTES)

    def mac(self, main: bytes, header: bytes) -> "blake3.blake3":
        """A MAC over `main` and `header`, to be fed the payload in order."""
        h = blake3.blake3(key=self._mac)
        h.update(struct.pack("<I", len(main)) + main + struct.pack("<I", len(header)) + header)
        return h

    def tail_value(self, parent: bytes, tail: bytes, length: int) -> bytes:
        """The tails hash's value for a tail of `length` tokens keyed `tail` under `parent`."""
        return b"%d:%s" % (length, self._tail_tag(parent, tail, length).hex().encode())

    def tail_length(self, parent: bytes, field: bytes, value: bytes) -> int | None:
        """The length a tails hash's (field, value) vouches for, or None if it is not
        a field a holder of the secret wrote (malformed or forged)."""
        try:
            tail = bytes.fromhex(field.decode("ascii"))
            n, tag = value.split(b":")
            length = int(n)
            good = len(tail) == 32 and 0 < length < 1 << 31 and n == b"%d" % length
        except (ValueError, UnicodeDecodeError):
            return None
        return length if good and tag == self._tail_tag(parent, tail, length).hex().encode() else None

    def _tail_tag(self, parent: bytes, tail: bytes, length: int) -> bytes:
        return blake3.blake3(tails_key(parent) + tail + struct.pack("<I", length), key=self._tail).digest(TAG_BYTES)


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
    """The remote key of an entry: kvd:2:{<hex chain key>}, with ":b" for boundary state."""
    return PREFIX + b"{" + key.hex().encode() + (b"}:b" if kind == 1 else b"}")


def part_key(main: bytes, i: int) -> bytes:
    """The key of part `i` (1-based past the main value) of a split value."""
    return main + b":p%d" % i


def tails_key(parent: bytes) -> bytes:
    """The hash listing the tail chunks stored under `parent` (field: hex key, value: length)."""
    return PREFIX + b"{" + parent.hex().encode() + b"}:tails"


def encode(entry: RemoteEntry, part_bytes: int, auth: RemoteKey) -> list[bytes]:
    """The values of `entry`, signed with `auth`: [main value, part 1, part 2, ...],
    each holding at most `part_bytes` of payload (the main value also holds the
    header); more if the entry would otherwise need over MAX_PARTS parts."""
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
    main = value_key(entry.key, entry.kind)
    payload = b"".join(memoryview(t.data).cast("B") for t in entry.tensors)
    mac = auth.mac(main, header)
    mac.update(payload)
    fixed = _FIXED.pack(MAGIC, len(header), auth.key_tag(main), mac.digest())
    return [fixed + header + payload[:part_bytes]] + [payload[i * part_bytes : (i + 1) * part_bytes] for i in range(1, parts)]


def vouched(prefix: bytes | memoryview, key: bytes, kind: int, auth: RemoteKey) -> bool:
    """Whether the first PRESENCE_BYTES of a value (a GETRANGE's reply; empty
    for a missing key) carry the key tag of the entry `key`/`kind` names: a
    holder of the secret stored a value there. The value itself is checked
    (`decode`) when it is read."""
    if len(prefix) < PRESENCE_BYTES:
        return False
    magic, _, tag = struct.unpack_from("<4sI16s", prefix)
    return magic == MAGIC and tag == auth.key_tag(value_key(key, kind))


@dataclass(slots=True)
class Head:
    """A main value's header, read before its parts are fetched (not yet
    authenticated: `decode` checks the tag and the MAC)."""

    fields: dict[str, Any]
    tag: bytes
    mac: bytes
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
    magic, hlen, tag, mac = _FIXED.unpack_from(view)
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
    return Head(fields, tag, mac, header, view[_FIXED.size + hlen :])


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


def decode(head: Head, parts: Sequence[bytes | memoryview | None], *, key: bytes, kind: int,
           auth: RemoteKey) -> RemoteEntry:
    """The entry of a main value (`head`) and its parts 1.. (None: missing).

    Raises ForgedRemoteValue unless a holder of `auth`'s secret wrote exactly
    this value under the key `key`/`kind` names, BadRemoteValue if it is not
    whole (a part missing or of another length, a header naming another entry).
    """
    f = head.fields
    main = value_key(key, kind)
    if head.tag != auth.key_tag(main):
        raise ForgedRemoteValue("key tag is not this key's under the shared secret")
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
    mac = auth.mac(main, head.header)
    for v in views:
        mac.update(v)
    if mac.digest() != head.mac:
        raise ForgedRemoteValue("MAC mismatch: not written by a holder of the shared secret, or altered since")
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
