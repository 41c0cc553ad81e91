"""Encode, decode and validate kvd/1 messages. Sans I/O.

Why one module of ~900 lines: it is the protocol's rules as code, and a rule
read apart from the table it serves is a rule misread; the header's bounded
unpacking (skim.py) and the shm plane's wire pieces (shm.py) live apart, and
the chunks' tight-loop checks (`_chunks_fast`, `LazyChunks`) would go next.

A message is a list of frames: frame 0 is a msgpack map (the header), frames
1..N-1 are raw tensor bytes that the header refers to by index. This module
turns frames into a `Message` (checking every rule in proto/PROTOCOL.md) and
a `Message` into frames. It never touches a socket, so it is tested byte for
byte against proto/vectors/ and fuzzed.

Rules the decoder enforces, in order (the first broken rule is the error):
 1. frame count <= max_frames; total bytes <= max_message_bytes
 2. frame 0 is msgpack, <= max_header_bytes, and decodes to a map
 3. "v" is a supported version (HELLO is accepted at any "v")
 4. "type" names a message of kvd/1 (for requests or for replies)
 5. "id", if present, is an unsigned 64-bit int
 6. every field of the type's schema has the right type and range;
    unknown fields are ignored
 7. every tensor: known dtype, rank <= max_rank, frame index in 1..N-1,
    used once, and byte length == prod(shape) * itemsize
 8. every data frame is referenced by exactly one tensor
A GET reply's placed chunks (section 14) name tensors by layout: heads are
checked as tensors are (rule 7), places are 24 bytes a head, and tensors
placed count against max_frames as tensors in frames do.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from kvd.protocol import dtypes, keys, skim
from kvd.protocol import errors as E
from kvd.protocol.limits import DEFAULT_LIMITS, Limits
from kvd.protocol.shm import Descriptor

VERSION = 1
SUPPORTED_VERSIONS = (1,)
U64 = 2**64


# Not frozen (never changed once made, all the same): a frozen dataclass's
# __init__ sets each field through object.__setattr__, ~1 us a Tensor against
# ~0.25, and a GET of a 1 GiB cache over shared memory makes 4,096 of them
# and their Descriptors on the waiting caller's thread (so does the daemon
# for each tensor of a PUT). Hashable as before.
@dataclass(slots=True, unsafe_hash=True)
class Tensor:
    """One named tensor: wire dtype name, shape, and its raw bytes.

    `data` is any object exposing a contiguous buffer of exactly
    prod(shape) * itemsize(dtype) bytes (bytes, memoryview, numpy array,
    a received ZeroMQ frame's buffer) -- or, in a reply over the
    shared-memory plane, a `Descriptor` of where the bytes are (section 14),
    or None in a SLOTS request, which asks for room rather than sending bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, Descriptor):
            return self.data.length
        if self.data is None:
            return math.prod(self.shape) * dtypes.itemsize(self.dtype)
        return memoryview(self.data).nbytes


@dataclass(slots=True)
class Message:
    """A decoded (or to-be-encoded) message: its type, id and fields.

    Tensor descriptors inside `fields` hold `Tensor` objects, not frame indices.
    """

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    id: int = 0

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


# -- field validators --------------------------------------------------------
# Each takes (value, ctx) and returns the value to keep, or raises BadField.
# `ctx` carries the limits and the frames for tensor descriptors.


class _Ctx:
    __slots__ = ("limits", "frames", "used", "path", "shm_ok", "lazy", "layouts", "placed")

    def __init__(self, limits: Limits, frames: list[Any], shm_ok: bool = False):
        self.limits, self.frames, self.used, self.path = limits, frames, set(), ""
        self.lazy: LazyChunks | None = None  # a PUT's chunks left to decode in turns
        self.shm_ok = shm_ok  # replies may place a tensor in shared memory instead of a frame
        # A GET reply's `layouts` (section 14, placed chunks): per layout, each
        # tensor's (name, dtype, shape, bytes); and how many tensors its chunks
        # placed so far (at most max_frames, as tensors in frames are).
        self.layouts: list[list[tuple[str, str, tuple[int, ...], int]]] | None = None
        self.placed = 0


def _bad(ctx: _Ctx, what: str) -> E.BadField:
    return E.BadField(f"field {ctx.path!r}: {what}")


def _uint(v, ctx):
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < U64:
        raise _bad(ctx, f"expected an unsigned integer, got {type(v).__name__}")
    return v


def _bool(v, ctx):
    if not isinstance(v, bool):
        raise _bad(ctx, f"expected a boolean, got {type(v).__name__}")
    return v


def _number(v, ctx):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _bad(ctx, "expected a finite non-negative number")
    return float(v)


def _str(v, ctx):
    if not isinstance(v, str):
        raise _bad(ctx, f"expected a string, got {type(v).__name__}")
    return v


def _map(v, ctx):
    if not isinstance(v, dict):
        raise _bad(ctx, f"expected a map, got {type(v).__name__}")
    return v


_META_DEPTH = 32  # ns_meta nests at most this deep (kvd_client's: 4-6, a model config inside); deeper, and a compare recursed past Python's limit


def _meta_map(v, ctx):
    """A map of namespace metadata: any values, nested at most _META_DEPTH deep."""
    _map(v, ctx)
    level, depth = [v], 1
    while level:
        level = [x for c in level for x in (c.values() if isinstance(c, dict) else c) if isinstance(x, (dict, list))]
        depth += bool(level)
        if depth > _META_DEPTH:
            raise _bad(ctx, f"nested deeper than {_META_DEPTH}")
    return v


def _uints(v, ctx):
    if not isinstance(v, list):
        raise _bad(ctx, f"expected an array, got {type(v).__name__}")
    return [_uint(x, ctx) for x in v]


def _ns(v, ctx):
    _str(v, ctx)
    if not v or len(v.encode("utf-8")) > ctx.limits.max_namespace_bytes:
        raise _bad(ctx, f"namespace must be 1..{ctx.limits.max_namespace_bytes} UTF-8 bytes")
    return v


def _chunk_tokens(v, ctx):
    _uint(v, ctx)
    if not 1 <= v <= ctx.limits.max_chunk_tokens:
        raise _bad(ctx, f"chunk_tokens must be 1..{ctx.limits.max_chunk_tokens}")
    return v


def _token_view(v, ctx):
    """A query's tokens, left where they are: a memoryview into the received
    frame when the header was big (kvd.protocol.skim). The handler reads at
    most `max_chunks` chunks of them and keeps none."""
    if not isinstance(v, (bytes, bytearray, memoryview)):
        raise _bad(ctx, f"expected bin (little-endian uint32 token ids), got {type(v).__name__}")
    if len(v) % 4:
        raise _bad(ctx, "token bytes must be a multiple of 4")
    if len(v) // 4 > ctx.limits.max_tokens:
        raise E.TooManyTokens(f"{len(v) // 4} tokens; the limit is {ctx.limits.max_tokens}")
    return v


def _tokens(v, ctx):
    """A stored sequence's tokens, as bytes of their own (a PUT's are kept)."""
    return bytes(_token_view(v, ctx))


def _media(v, ctx):
    # Shape only; whether the spans fit the tokens is the handler's check
    # (keys.check_media), which knows the token count.
    if not isinstance(v, list) or len(v) > keys.MAX_MEDIA_SPANS:
        raise _bad(ctx, f"expected an array of at most {keys.MAX_MEDIA_SPANS} media spans")
    spans = []
    for x in v:
        _map(x, ctx)
        start, end, digest = x.get("start"), x.get("end"), x.get("hash")
        for name, val in (("start", start), ("end", end)):
            if isinstance(val, bool) or not isinstance(val, int) or not 0 <= val < 2**32:
                raise _bad(ctx, f"a media span needs an unsigned 32-bit {name!r}")
        if not isinstance(digest, (bytes, bytearray)) or len(digest) != keys.DIGEST_BYTES:
            raise _bad(ctx, f"a media span needs a {keys.DIGEST_BYTES}-byte bin 'hash'")
        spans.append({"start": start, "end": end, "hash": bytes(digest)})
    return spans


def _meta(v, ctx):
    if not isinstance(v, (bytes, bytearray)):
        raise _bad(ctx, f"expected bin, got {type(v).__name__}")
    if len(v) > ctx.limits.max_meta_bytes:
        raise _bad(ctx, f"meta is {len(v)} bytes; the limit is {ctx.limits.max_meta_bytes}")
    return bytes(v)


def _bin(v, ctx):
    if type(v) is not bytes:
        raise _bad(ctx, f"expected bin, got {type(v).__name__}")
    return v


def _entry_ids(v, ctx):
    if not isinstance(v, list) or len(v) > 65536:
        raise _bad(ctx, "expected an array of at most 65536 entry ids")
    for x in v:
        if not isinstance(x, (bytes, bytearray)) or len(x) != 33:
            raise _bad(ctx, "an entry id is 33 bytes of bin (chunk key + kind)")
    return [bytes(x) for x in v]


def _tensor_head(v, ctx) -> tuple[str, str, list[int]]:
    _map(v, ctx)
    name, dtype, shape = v.get("name"), v.get("dtype"), v.get("shape")
    if not isinstance(name, str):
        raise _bad(ctx, "tensor needs a string 'name'")
    if not isinstance(dtype, str):
        raise _bad(ctx, f"tensor {name!r} needs a string 'dtype'")
    if dtype not in dtypes.DTYPES:
        raise E.BadDtype(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise E.BadShape(f"tensor {name!r}: shape must be an array of non-negative integers")
    if len(shape) > ctx.limits.max_rank:
        raise E.BadShape(f"tensor {name!r}: rank {len(shape)} exceeds {ctx.limits.max_rank}")
    return name, dtype, shape


def _tensor_spec(v, ctx) -> Tensor:
    """A tensor a SLOTS request asks room for: name, dtype and shape, no bytes."""
    name, dtype, shape = _tensor_head(v, ctx)
    return Tensor(name, dtype, tuple(shape), None)


def _tensor(v, ctx) -> Tensor:
    name, dtype, shape = _tensor_head(v, ctx)
    idx = v.get("frame")
    want = math.prod(shape) * dtypes.itemsize(dtype)
    if idx is None and ctx.shm_ok and "shm" in v:
        desc = _descriptor(v["shm"], ctx)
        if "xxh3" in v:
            desc = Descriptor(desc.segment, desc.offset, desc.length, _uint(v["xxh3"], ctx))
        if desc.length != want:
            raise E.BadShape(f"tensor {name!r}: {desc.length} bytes in shared memory for {dtype}{shape}, expected {want}")
        return Tensor(name, dtype, tuple(shape), desc)
    if isinstance(idx, bool) or not isinstance(idx, int) or not 1 <= idx < len(ctx.frames):
        raise E.BadFrameIndex(f"tensor {name!r}: frame {idx!r} not in 1..{len(ctx.frames) - 1}")
    if idx in ctx.used:
        raise E.BadFrameIndex(f"tensor {name!r}: frame {idx} already used by another tensor")
    ctx.used.add(idx)
    data = ctx.frames[idx]
    have = memoryview(data).nbytes
    if have != want:
        raise E.BadShape(f"tensor {name!r}: {have} bytes for {dtype}{shape}, expected {want}")
    return Tensor(name, dtype, tuple(shape), data)


def _named(tensors: list[Tensor], ctx) -> list[Tensor]:
    """One chunk's tensors become one safetensors blob: names unique, none its header's."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise _bad(ctx, "tensor names must be unique within a chunk and not '__metadata__'")
    return tensors


def _tensors(v, ctx):
    if not isinstance(v, list):
        raise _bad(ctx, "expected an array of tensors")
    return _named([_tensor(t, ctx) for t in v], ctx)


def _tensor_specs(v, ctx):
    if not isinstance(v, list):
        raise _bad(ctx, "expected an array of tensors")
    return _named([_tensor_spec(t, ctx) for t in v], ctx)


def _descriptor(v, ctx) -> Descriptor:
    # Shape only: whether it fits a segment is checked by the peer that maps it.
    if not isinstance(v, list) or len(v) != 3:
        raise _bad(ctx, "a shared-memory descriptor is [segment, offset, length]")
    return Descriptor(*(_uint(x, ctx) for x in v))


def _descriptors(v, ctx):
    if not isinstance(v, list):
        raise _bad(ctx, "expected an array of descriptors")
    return [_descriptor(x, ctx) for x in v]


def _layouts(v, ctx):
    """A GET reply's `layouts` (section 14): arrays of tensor heads `[name,
    dtype, shape]`, each checked as a tensor's are, names unique within a
    layout; at most max_chunks layouts and max_frames heads in all. Kept as
    sent (for the encoder); what its chunks need is kept in `ctx.layouts`."""
    if not isinstance(v, list) or len(v) > ctx.limits.max_chunks:
        raise _bad(ctx, f"expected an array of at most {ctx.limits.max_chunks} layouts")
    heads, out = 0, []
    for layout in v:
        if not isinstance(layout, list):
            raise _bad(ctx, "a layout is an array of tensor heads")
        heads += len(layout)
        if heads > ctx.limits.max_frames:
            raise _bad(ctx, f"layouts name more than {ctx.limits.max_frames} tensors")
        got = []
        for head in layout:
            if not isinstance(head, list) or len(head) != 3:
                raise _bad(ctx, "a tensor head is [name, dtype, shape]")
            name, dtype, shape = _tensor_head({"name": head[0], "dtype": head[1], "shape": head[2]}, ctx)
            nbytes = math.prod(shape) * dtypes.itemsize(dtype)
            if nbytes >= U64:
                raise E.BadShape(f"tensor {name!r}: {dtype}{shape} is more than 2**64 bytes")
            got.append((name, dtype, tuple(shape), nbytes))
        names = [h[0] for h in got]
        if len(set(names)) != len(names) or "__metadata__" in names:
            raise _bad(ctx, "tensor names must be unique within a layout and not '__metadata__'")
        out.append(got)
    ctx.layouts = out
    return v


_PLACE = 24  # bytes a placed tensor takes in a chunk's `places`: segment, offset, xxh3 (u64 LE each)


def _placed(index, places, ctx) -> list[Tensor] | None:
    """A placed chunk's tensors: those of layout `index`, each in shared
    memory at the segment and offset `places` gives, with its digest; None
    where that is not plainly so (the caller raises the exact error)."""
    layouts = ctx.layouts
    if type(index) is not int or layouts is None or not 0 <= index < len(layouts) or type(places) is not bytes:
        return None
    heads = layouts[index]
    if len(places) != _PLACE * len(heads) or ctx.placed + len(heads) > ctx.limits.max_frames:
        return None
    ctx.placed += len(heads)
    words = iter(struct.unpack(f"<{3 * len(heads)}Q", places))
    return [Tensor(name, dtype, shape, Descriptor(seg, off, nbytes, digest))
            for (name, dtype, shape, nbytes), seg, off, digest in zip(heads, words, words, words)]


def _get_chunk(v, ctx):
    """One chunk of a GET reply: its tensors, or (section 14) a `layout` and
    the `places` of its tensors in shared memory."""
    _map(v, ctx)
    if v.get("layout") is None:
        return _apply(_GET_CHUNK, v, ctx)
    if v.get("tensors") is not None:
        raise _bad(ctx, "a chunk has tensors or a layout, not both")
    out = _apply(_PLACED_CHUNK, v, ctx)
    if ctx.layouts is None or out["layout"] >= len(ctx.layouts):
        raise _bad(ctx, f"layout {out['layout']} is not one of the reply's {len(ctx.layouts or ())} layouts")
    heads = len(ctx.layouts[out["layout"]])
    if len(out["places"]) != _PLACE * heads:
        raise _bad(ctx, f"{len(out['places'])} bytes of places for a layout of {heads} tensors, expected {_PLACE * heads}")
    if ctx.placed + heads > ctx.limits.max_frames:
        raise _bad(ctx, f"chunks place more than {ctx.limits.max_frames} tensors")
    out["tensors"] = _placed(out["layout"], out["places"], ctx)
    return out


def _record(schema: dict[str, tuple[Callable, bool, Any]]) -> Callable:
    """A validator for a map with its own field schema (a chunk, a boundary)."""

    def check(v, ctx):
        _map(v, ctx)
        return _apply(schema, v, ctx)

    return check


def _array_of(item: Callable) -> Callable:
    def check(v, ctx):
        if not isinstance(v, list):
            raise _bad(ctx, "expected an array")
        return [item(x, ctx) for x in v]

    return check


def _put_chunks(v, ctx):
    """A PUT's chunks (LazyChunks when the header left them undecoded), checked in one tight loop: a PUT of 8,000 tiny chunks
    took ~50 ms of the serving thread through the generic schema walk (a
    path string, a call per field; issue 44), ~4x less here. Anything the
    loop does not take as plainly valid goes the generic way, which finds
    the same first broken rule and raises its exact error."""
    if isinstance(v, skim.Items):
        ctx.lazy = LazyChunks(v, ctx)
        return ctx.lazy
    fast = _put_chunks_fast(v, ctx)
    return fast if fast is not None else _GENERIC_PUT_CHUNKS(v, ctx)


class LazyChunks:
    """A long PUT's chunks, still msgpack in its header (skim.Items):
    `steps()` decodes and checks them `batch` at a time, yielding between
    batches, and returns them as the PUT decoded whole would have them --
    the same rules in the same order, the same first error -- then checks
    that every frame was referenced. The handler runs the steps in turns
    (kvd.server.handler, issue 44): a PUT of 8,000 tiny chunks held the
    serving thread ~45 ms to decode in one piece."""

    __slots__ = ("_items", "_ctx")

    def __init__(self, items: "skim.Items", ctx: "_Ctx"):
        self._items, self._ctx = items, ctx

    def __len__(self) -> int:
        return len(self._items)

    def steps(self, batch: int = 64):
        ctx, left, out = self._ctx, len(self._items), []
        unpacker = self._items.unpacker()
        while left:
            take = min(batch, left)
            try:
                raw = [unpacker.unpack() for _ in range(take)]
            except E.ProtocolError:
                raise
            except Exception as exc:  # msgpack raises a zoo of types for garbage
                raise E.MalformedMessage(f"header is not valid msgpack: {exc.__class__.__name__}") from None
            ctx.path = "chunks"
            fast = _put_chunks_fast(raw, ctx)
            out.extend(fast if fast is not None else _GENERIC_PUT_CHUNKS(raw, ctx))
            left -= take
            yield
        _all_frames_used(ctx)
        return out


def _put_chunks_fast(v, ctx) -> list | None:
    return _chunks_fast(v, ctx, ("index",))


def _get_chunks(v, ctx):
    """A GET reply's chunks, checked in one tight loop as a PUT's are
    (`_put_chunks`): a reply naming 2,048 tensors in shared memory took the
    waiting client ~6-12 us a tensor through the generic schema walk."""
    placed = ctx.placed
    fast = _chunks_fast(v, ctx, ("start", "length"))
    if fast is not None:
        return fast
    ctx.placed = placed  # (what the fast loop placed is placed again)
    return _GENERIC_GET_CHUNKS(v, ctx)


def _chunks_fast(v, ctx, uints: tuple[str, ...]) -> list | None:
    """Chunks of `uints` (unsigned fields), tensors and meta, as the generic
    walk would have them, or None for anything not plainly valid. A GET
    reply's (`start`, `length`) may be placed (section 14); a PUT chunk's
    `layout` is a field like any unknown one."""
    placing = uints == ("start", "length")
    if type(v) is not list:
        return None
    max_meta = ctx.limits.max_meta_bytes
    used = set(ctx.used)
    out = []
    for c in v:
        if type(c) is not dict:
            return None
        chunk = {}
        for name in uints:
            x = c.get(name)
            if type(x) is not int or not 0 <= x < U64:
                return None
            chunk[name] = x
        meta = c.get("meta")
        if meta is None:
            meta = b""
        elif type(meta) is not bytes or len(meta) > max_meta:
            return None
        layout = c.get("layout") if placing else None
        if layout is not None:  # a GET reply's placed chunk (section 14)
            got = None if c.get("tensors") is not None else _placed(layout, c.get("places"), ctx)
            if got is None:
                return None
            chunk["layout"], chunk["places"], chunk["meta"], chunk["tensors"] = layout, c["places"], meta, got
            out.append(chunk)
            continue
        got = _tensors_fast(c.get("tensors"), ctx, used)
        if got is None:
            return None
        chunk["tensors"], chunk["meta"] = got, meta
        out.append(chunk)
    ctx.used = used
    return out


def _tensors_fast(tensors, ctx, used: set) -> list | None:
    """One chunk's tensors, as `_tensors` would have them, or None for
    anything not plainly valid (the caller then takes the generic way, for
    the exact first error). Frames taken are added to `used`; a caller
    that gets None discards `used`."""
    if type(tensors) is not list:
        return None
    frames, table = ctx.frames, dtypes.DTYPES
    nframes, max_rank, shm_ok = len(frames), ctx.limits.max_rank, ctx.shm_ok
    got = []
    for t in tensors:
        if type(t) is not dict:
            return None
        name, dtype, shape, idx = t.get("name"), t.get("dtype"), t.get("shape"), t.get("frame")
        if type(name) is not str or type(dtype) is not str or type(shape) is not list:
            return None
        size = table.get(dtype)
        if size is None or len(shape) > max_rank:
            return None
        n = size[0]
        for d in shape:
            if type(d) is not int or d < 0:
                return None
            n *= d
        if idx is None and shm_ok and "shm" in t:
            desc, digest = t["shm"], t.get("xxh3")
            if type(desc) is not list or len(desc) != 3:
                return None
            seg, off, length = desc
            if (type(seg) is not int or type(off) is not int or type(length) is not int
                    or not 0 <= seg < U64 or not 0 <= off < U64 or length != n):
                return None
            if digest is not None and (type(digest) is not int or not 0 <= digest < U64):
                return None
            if digest is None and "xxh3" in t:
                return None
            got.append(Tensor(name, dtype, tuple(shape), Descriptor(seg, off, length, digest)))
            continue
        if type(idx) is not int or not 1 <= idx < nframes or idx in used:
            return None
        data = frames[idx]
        if (len(data) if type(data) is bytes else memoryview(data).nbytes) != n:
            return None
        used.add(idx)
        got.append(Tensor(name, dtype, tuple(shape), data))
    if len(got) > 1:
        names = [x.name for x in got]
        if len(set(names)) != len(names) or "__metadata__" in names:
            return None
    elif got and got[0].name == "__metadata__":
        return None
    return got


def _req(check):
    return (check, True, None)


def _opt(check, default=None):
    return (check, False, default)


_PUT_CHUNK = {"index": _req(_uint), "tensors": _req(_tensors), "meta": _opt(_meta, b"")}
_GENERIC_PUT_CHUNKS = _array_of(_record(_PUT_CHUNK))
_GET_CHUNK = {"start": _req(_uint), "length": _req(_uint), "tensors": _req(_tensors), "meta": _opt(_meta, b"")}
_PLACED_CHUNK = {"start": _req(_uint), "length": _req(_uint), "layout": _req(_uint), "places": _req(_bin),
                 "meta": _opt(_meta, b"")}
_GENERIC_GET_CHUNKS = _array_of(_get_chunk)
_BOUNDARY = {"tensors": _req(_tensors), "meta": _opt(_meta, b"")}
_BOUNDARY_AT = {"at": _req(_uint), "tensors": _req(_tensors), "meta": _opt(_meta, b"")}
_SLOTS_CHUNK = {"index": _req(_uint), "tensors": _req(_tensor_specs), "meta": _opt(_meta, b"")}
_SLOTS_BOUNDARY = {"tensors": _req(_tensor_specs), "meta": _opt(_meta, b"")}
_SEQ = {"ns": _req(_ns), "tokens": _req(_tokens), "chunk_tokens": _opt(_chunk_tokens, 256), "media": _opt(_media)}
_QUERY = {**_SEQ, "tokens": _req(_token_view)}  # LOOKUP, GET, EXPLAIN: tokens read, never kept

_PUT_REPLY = {"stored": _req(_uint), "duplicate": _req(_uint), "too_big": _req(_uint), "dropped": _opt(_uint, 0)}

# The message table: type -> field schema, for requests and for replies.
REQUESTS: dict[str, dict[str, tuple[Callable, bool, Any]]] = {
    "HELLO": {"versions": _req(_uints), "client": _opt(_str, ""), "lanes": _opt(_bool, False)},
    "PING": {},
    "LOOKUP": {**_QUERY},
    "GET": {
        **_QUERY, "max_tokens": _opt(_uint), "need_boundary": _opt(_bool, False), "start": _opt(_uint, 0),
        "shm": _opt(_map),  # section 14: proof and releases; the reply may then carry descriptors
    },
    "PUT": {
        **_SEQ, "chunks": _req(_put_chunks), "boundary": _opt(_record(_BOUNDARY)), "ns_meta": _opt(_meta_map),
    },
    "EXPLAIN": {**_QUERY, "need_boundary": _opt(_bool, False), "ns_meta": _opt(_meta_map)},
    "SLOTS": {
        **_SEQ, "chunks": _req(_array_of(_record(_SLOTS_CHUNK))), "boundary": _opt(_record(_SLOTS_BOUNDARY)),
        "ns_meta": _opt(_meta_map), "shm": _req(_map),
    },
    "COMMIT": {"lease": _req(_uint), "shm": _req(_map), "digests": _opt(_uints), "more": _opt(_bool, False)},
    "STATS": {"ns": _opt(_ns)},
    "GC": {
        "ram_bytes": _opt(_uint),
        "ssd_bytes": _opt(_uint),
        "ns": _opt(_ns),
        "older_than": _opt(_number),
        "orphans": _opt(_bool, False),
        "recheck": _opt(_entry_ids),
        "dry_run": _opt(_bool, False),
    },
    "SHUTDOWN": {},
}
REPLIES: dict[str, dict[str, tuple[Callable, bool, Any]]] = {
    "HELLO": {
        "version": _req(_uint), "server": _req(_str), "limits": _req(_map), "chunk_tokens": _req(_uint),
        "features": _opt(_array_of(_str), ()),
        "shm": _opt(_map),
        "shm_live": _opt(_uints), "shm_window": _opt(_record({"left": _req(_uint), "next": _req(_uint)})),
        "lane": _opt(_str),
    },
    "PING": {},
    "LOOKUP": {"n": _req(_uint), "boundaries": _req(_uints)},
    "GET": {
        "n": _req(_uint),
        "end": _req(_uint),
        "layouts": _opt(_layouts),  # (before the chunks that name them)
        "chunks": _req(_get_chunks),
        "boundary": _opt(_record(_BOUNDARY_AT)),
        "shm": _opt(_map),
    },
    "PUT": _PUT_REPLY,
    "SLOTS": {
        "lease": _req(_uint), "run": _req(_str), "lease_s": _req(_number),
        "chunks": _req(_array_of(_descriptors)), "boundary": _opt(_descriptors), "segments": _opt(_uints),
    },
    "COMMIT": _PUT_REPLY,
    "EXPLAIN": {
        "n": _req(_uint), "tokens": _req(_uint), "reason": _req(_str), "message": _req(_str),
        "boundaries": _req(_uints), "detail": _opt(_map),
    },
    "STATS": {"stats": _req(_map)},
    "GC": {"entries": _req(_uint), "bytes": _req(_uint), "dry_run": _req(_bool), "details": _opt(_map)},
    "SHUTDOWN": {},
    "ERROR": {"code": _req(_uint), "name": _req(_str), "message": _opt(_str, "")},
}


def _apply(schema, raw: dict, ctx: _Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = ctx.path
    for name, (check, required, default) in schema.items():
        ctx.path = f"{base}.{name}" if base else name
        if name not in raw or raw[name] is None:
            if required:
                raise E.BadField(f"missing required field {ctx.path!r}")
            if default is not None:
                out[name] = default
            continue
        out[name] = check(raw[name], ctx)
    ctx.path = base
    return out


# -- decoding ------------------------------------------------------------------


def _unpack_header(frames: list[Any], limits: Limits) -> dict:
    if not frames:
        raise E.MalformedMessage("empty message")
    if len(frames) > limits.max_frames:
        raise E.TooManyFrames(f"{len(frames)} frames; the limit is {limits.max_frames}")
    total = sum(memoryview(f).nbytes for f in frames)
    if total > limits.max_message_bytes:
        raise E.MessageTooLarge(f"{total} bytes; the limit is {limits.max_message_bytes}")
    head = memoryview(frames[0])
    if head.nbytes > limits.max_header_bytes:
        raise E.MessageTooLarge(f"header of {head.nbytes} bytes; the limit is {limits.max_header_bytes}")
    try:
        header = _unpackb(head, limits)
    except E.ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for garbage
        raise E.MalformedMessage(f"header is not valid msgpack: {exc.__class__.__name__}") from None
    if not isinstance(header, dict):
        raise E.MalformedMessage(f"header must be a map, got {type(header).__name__}")
    return header


def _unpackb(buf: Any, limits: Limits) -> Any:
    """msgpack.unpackb with the memory a header may cost bounded *while* it
    is decoded, not after: a hostile 16 MiB header of empty maps would
    otherwise become 16 M Python objects (GBs) before any rule could reject
    it. Every container counts against `limits.max_header_objects` (msgpack
    calls the hooks as each one completes, so decoding stops within that
    many), and so do their items against `limits.max_header_items` (every
    scalar is an item of some container: a nil or a short string costs ~8-60
    bytes decoded, for one to three on the wire); strings and byte strings
    against the header size."""
    budget = [limits.max_header_objects, limits.max_header_items]

    def count(obj):
        budget[0] -= 1
        budget[1] -= len(obj)
        if budget[0] < 0:
            raise E.MalformedMessage(f"header has more than {limits.max_header_objects} maps and arrays")
        if budget[1] < 0:
            raise E.MalformedMessage(f"header has more than {limits.max_header_items} items in its maps and arrays")
        return obj

    view = memoryview(buf)
    n = view.nbytes
    args = dict(
        raw=False, strict_map_key=True, use_list=True, object_hook=count, list_hook=count,
        max_bin_len=n, max_str_len=n, max_array_len=limits.max_header_objects,
        max_map_len=limits.max_header_objects, max_ext_len=0,
    )
    if n >= skim.SKIM_BYTES and view.ndim == 1 and view.format == "B":
        header = skim.top_level(view, {**args, "max_buffer_size": max(n, skim.READ_BYTES)}, count)
        if header is not None:
            return header
    return msgpack.unpackb(buf, **args)


def peek_id(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> int | None:
    """The request id of a message, if its header can be read at all (for error replies):
    from its first bytes where it is (every encoder puts it there), else from the whole header."""
    mid = _peek(frames[0]).get("id") if frames else None
    if isinstance(mid, int) and not isinstance(mid, bool) and 0 <= mid < U64:
        return mid
    try:
        if memoryview(frames[0]).nbytes > limits.max_header_bytes:
            return None
        header = _unpackb(memoryview(frames[0]), limits)
        mid = header.get("id") if isinstance(header, dict) else None
        return mid if isinstance(mid, int) and not isinstance(mid, bool) and 0 <= mid < U64 else None
    except Exception:
        return None


_PEEK_BYTES = 64  # "v", "type" and "id" come first in every encoder's header (encode)


def peek_type(frame: Any) -> str | None:
    """A request's type, read from the first bytes of its header without
    decoding the rest (the loop orders requests by it before it decodes
    them, kvd.server.admission.ready); None when those bytes do not say.
    Only a hint: the request is decoded and checked in full when served."""
    value = _peek(frame).get("type")
    return value if isinstance(value, str) else None


def _peek(frame: Any) -> dict[str, Any]:
    """Of the first three fields of a header, those within its first
    _PEEK_BYTES bytes ({} for garbage)."""
    out: dict[str, Any] = {}
    try:
        head = bytes(memoryview(frame)[:_PEEK_BYTES])
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_PEEK_BYTES, max_str_len=16, max_bin_len=0,
                                    max_array_len=0, max_map_len=64, max_ext_len=0)
        unpacker.feed(head)
        for _ in range(min(unpacker.read_map_header(), 3)):
            key = unpacker.unpack()
            value = unpacker.unpack()
            if key in ("type", "id") and key not in out:
                out[key] = value
    except Exception:  # garbage, or cut short within the first bytes
        pass
    return out


def _decode(frames: list[Any], table, limits: Limits, shm_ok: bool = False) -> Message:
    header = _unpack_header(frames, limits)
    mtype = header.get("type")
    version = header.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise E.BadField("field 'v' must be an integer protocol version")
    if version not in SUPPORTED_VERSIONS and mtype != "HELLO":
        raise E.UnsupportedVersion(f"protocol version {version} not supported; this peer speaks {list(SUPPORTED_VERSIONS)}")
    if not isinstance(mtype, str):
        raise E.BadField("field 'type' must be a string")
    if mtype not in table:
        raise E.UnknownMessageType(f"unknown message type {mtype!r}")
    mid = header.get("id", 0)
    if isinstance(mid, bool) or not isinstance(mid, int) or not 0 <= mid < U64:
        raise E.BadField("field 'id' must be an unsigned 64-bit integer")
    schema = table[mtype]
    for name, value in header.items():
        if isinstance(value, skim.Items) and schema.get(name, (None,))[0] is not _put_chunks:
            header[name] = value.all()  # only a PUT's chunks are decoded in turns
    ctx = _Ctx(limits, frames, shm_ok)
    fields = _apply(table[mtype], header, ctx)
    if ctx.lazy is None:
        _all_frames_used(ctx)  # else when its chunks are (LazyChunks)
    return Message(mtype, fields, mid)


def _all_frames_used(ctx: "_Ctx") -> None:
    unused = set(range(1, len(ctx.frames))) - ctx.used
    if unused:
        raise E.BadFrameIndex(f"frame(s) {sorted(unused)[:8]} not referenced by any tensor")


def decode_request(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode a request. Raises the ProtocolError of the first broken rule."""
    return _decode(frames, REQUESTS, limits)


def whole(msg: Message) -> Message:
    """`msg` with a long PUT's chunks decoded (LazyChunks run to their end),
    for callers that do not serve it in turns. Raises what they raise."""
    lazy = msg.fields.get("chunks")
    if isinstance(lazy, LazyChunks):
        steps = lazy.steps()
        while True:
            try:
                next(steps)
            except StopIteration as done:
                msg.fields["chunks"] = done.value
                break
    return msg


def decode_reply(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode a reply (an ERROR reply decodes to type "ERROR")."""
    return _decode(frames, REPLIES, limits, shm_ok=True)


# -- encoding ------------------------------------------------------------------


def _wire_tensors(tensors, frames: list[Any]) -> list[dict]:
    out = []
    for t in tensors:
        if type(t) is dict:  # shm.shm_tensor's: in its wire form already
            out.append(t)
            continue
        wire = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}
        if isinstance(t.data, Descriptor):
            wire["shm"] = t.data.to_wire()
            if t.data.digest is not None:
                wire["xxh3"] = t.data.digest
        elif t.data is not None:
            frames.append(t.data)
            wire["frame"] = len(frames) - 1
        out.append(wire)
    return out


def _wire_fields(fields: dict[str, Any], frames: list[Any]) -> dict[str, Any]:
    out = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name == "chunks" and value and isinstance(value[0], dict):
            # (a placed chunk, section 14, goes as its layout and places: its tensors are those)
            value = [{k: x for k, x in c.items() if k != "tensors"} if c.get("layout") is not None
                     else {**c, "tensors": _wire_tensors(c["tensors"], frames)} for c in value]
        elif name == "boundary" and isinstance(value, dict):
            value = {**value, "tensors": _wire_tensors(value["tensors"], frames)}
        out[name] = value
    return out


def encode(mtype: str, fields: dict[str, Any] | None = None, *, id: int = 0, version: int = VERSION) -> list[Any]:
    """Frames for a message: [msgpack header, tensor data ...].

    Tensor data buffers are passed through untouched (no copy); the caller
    must keep them alive and unmodified until the frames are sent.
    The header's keys are written in a fixed order -- "v", "type", "id", then
    the fields in the order given -- so encodings are reproducible.
    """
    frames: list[Any] = [b""]
    header = {"v": version, "type": mtype, "id": id, **_wire_fields(fields or {}, frames)}
    frames[0] = msgpack.packb(header, use_bin_type=True, default=_wire_default)
    return frames


def _wire_default(obj: Any) -> Any:
    # Descriptors outside tensors (a SLOTS reply's grants) go out as their triple.
    if isinstance(obj, Descriptor):
        return obj.to_wire()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode_error(err: E.KvdError, *, id: int | None = 0) -> list[Any]:
    """Frames for an ERROR reply describing `err`."""
    return encode("ERROR", {"code": err.code, "name": err.name, "message": err.message}, id=id or 0)
