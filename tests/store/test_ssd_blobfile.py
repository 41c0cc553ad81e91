"""Blob format: real safetensors with true dtypes, deterministic, checked on read."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import struct

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from kvd.protocol import dtypes
from kvd.store.ssd import blobfile
from kvd.store.ssd.blobfile import BlobCorrupt, Unencodable
from kvd.store.base import Entry, Tensor

from support import ALL_DTYPES, assert_same, make_entry

# mlx 0.32's safetensors loader refuses F64 (mlx has no float64 on the GPU);
# the reference `safetensors` reader checks float64 blobs instead.
MX_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def _write(tmp_path, entry):
    path = tmp_path / "ab" / "blob.safetensors"
    info = blobfile.write_blob(path, entry)
    return path, info


def test_every_dtype_round_trips_and_mx_load_reads_true_dtypes(tmp_path):
    entry = make_entry(7, dtype_list=ALL_DTYPES, tokens=3, width=5)
    path, info = _write(tmp_path, entry)
    raw = path.read_bytes()
    assert info.file_size == len(raw) and info.checksum == xxhash.xxh3_64_intdigest(raw)
    assert oct(path.stat().st_mode & 0o777) == "0o600"

    fd = os.open(path, os.O_RDONLY)
    try:
        assert_same(blobfile.read_blob(fd, info.file_size, info.checksum), entry)
    finally:
        os.close(fd)

    # The reference reader (Rust safetensors) accepts the file: every dtype,
    # shape and byte as written.
    import safetensors

    ref = dict(safetensors.deserialize(raw))
    for t in entry.tensors:
        assert ref[t.name]["dtype"].lower() in (t.dtype, blobfile.ST_DTYPE[t.dtype].lower())
        assert list(ref[t.name]["shape"]) == list(t.shape)
        assert bytes(ref[t.name]["data"]) == bytes(t.data)

    no_f64 = make_entry(7, dtype_list=[d for d in ALL_DTYPES if d != "float64"], tokens=3, width=5)
    path, info = _write(tmp_path, no_f64)
    loaded, metadata = mx.load(str(path), return_metadata=True)
    assert metadata["kvd_key"] == entry.key.hex() and metadata["kvd_format"] == "1"
    for t in no_f64.tensors:
        arr = loaded[t.name]
        assert tuple(arr.shape) == tuple(t.shape)
        if t.dtype == "bfloat16":
            assert arr.dtype == mx.bfloat16  # stored as BF16, not widened
        else:
            assert arr.dtype == getattr(mx, "bool_" if t.dtype == "bool" else t.dtype)
        if t.dtype == "bool":
            got = np.array(arr).astype(np.uint8).tobytes()
        else:
            got = np.array(arr.view(MX_UINT[dtypes.itemsize(t.dtype)])).tobytes()
        assert got == bytes(t.data), t.dtype


def test_header_is_plain_safetensors(tmp_path):
    path, _ = _write(tmp_path, make_entry(1))
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header["t0.bfloat16"]["dtype"] == "BF16"
    assert all(isinstance(v, str) for v in header["__metadata__"].values())


def test_encoding_is_deterministic(tmp_path):
    a = blobfile.write_blob(tmp_path / "a" / "x.safetensors", make_entry(3))
    b = blobfile.write_blob(tmp_path / "b" / "x.safetensors", make_entry(3))
    assert a.checksum == b.checksum


def test_no_temp_file_left_and_unencodable_refused(tmp_path):
    _write(tmp_path, make_entry(2))
    assert [p.name for p in (tmp_path / "ab").iterdir()] == ["blob.safetensors"]
    dup = make_entry(2)
    bad = Entry(dup.namespace, dup.key, 0, dup.parent, 0, 1, (dup.tensors[0], dup.tensors[0]))
    with pytest.raises(Unencodable):
        blobfile.write_blob(tmp_path / "cd" / "x.safetensors", bad)
    short = Entry(dup.namespace, dup.key, 0, dup.parent, 0, 1, (Tensor("x", "float32", (3,), b"abc"),))
    with pytest.raises(Unencodable):
        blobfile.encode_header(short)


def test_garbage_is_either_parsed_or_blob_corrupt(tmp_path):
    """Fuzz rule: any bytes fed to the parser parse or raise BlobCorrupt, nothing else."""
    path, _ = _write(tmp_path, make_entry(5, tokens=2, width=4))
    good = path.read_bytes()
    rng = random.Random(1)
    for _ in range(600):
        buf = bytearray(good)
        op = rng.randrange(4)
        if op == 0:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif op == 1:
            del buf[rng.randrange(len(buf)) :]
        elif op == 2:
            buf[rng.randrange(8)] = rng.randrange(256)
        else:
            buf = bytearray(rng.randbytes(rng.randrange(64)))
        try:
            blobfile.parse_blob(buf)
        except BlobCorrupt:
            pass


def test_a_tensor_changed_while_written_still_makes_a_good_blob(tmp_path, monkeypatch):
    """A tensor in shared memory can change while the spill writer writes it
    (a client writing into its slot after COMMIT). The checksum was taken of
    the memory before the write, so the file held other bytes than its
    checksum said: a good blob quarantined later, an acknowledged entry lost
    (red-team). Each piece is now copied first, then hashed and written."""
    src = np.arange(3 * (1 << 20), dtype=np.uint8)  # 3 MiB: several pieces
    entry = Entry(namespace="ns", key=b"k" * 32, kind=0, parent=b"p" * 32, start=0, length=4,
                  tensors=(Tensor("k", "uint8", (src.size,), src),))
    real_write, calls = os.write, [0]

    def write(fd, data):
        calls[0] += 1
        if calls[0] == 2:  # the header went first: now the tensor's first piece
            src[:] = 0xAA  # the client writes on, in the middle of the spill
        return real_write(fd, data)

    monkeypatch.setattr(blobfile.os, "write", write)
    path, info = _write(tmp_path, entry)
    monkeypatch.undo()
    fd = os.open(path, os.O_RDONLY)
    try:
        got = blobfile.read_blob(fd, info.file_size, info.checksum)  # BlobCorrupt before
    finally:
        os.close(fd)
    data = np.frombuffer(memoryview(got.tensors[0].data).cast("B"), np.uint8)
    assert data.size == src.size and info.checksum == xxhash.xxh3_64_intdigest(path.read_bytes())
    assert (data[: 1 << 20] == np.arange(1 << 20, dtype=np.uint8)).all()  # the piece as copied


class _Slot(np.ndarray):
    """A tensor's bytes in a shared-memory slot, with the digest fixed at COMMIT."""

    digest: int | None = None


def test_a_slot_changed_after_commit_is_checked_as_written_and_nothing_lands(tmp_path, monkeypatch):
    """Slot tensors are written from the slot (no private copy of the whole
    entry) and checked against their COMMIT digest as they are written: a
    scribble in the middle of the write raises Altered, and neither the blob
    nor its temp file is left. One untouched is written, preallocated."""
    src = np.arange(3 * (1 << 20), dtype=np.uint8).view(_Slot)  # 3 MiB: several pieces
    src.digest = xxhash.xxh3_64_intdigest(src.tobytes())
    entry = Entry(namespace="ns", key=b"k" * 32, kind=0, parent=b"p" * 32, start=0, length=4,
                  tensors=(Tensor("k", "uint8", (src.size,), src),))
    path, info = _write(tmp_path, entry)  # untouched: written
    assert os.stat(path).st_blocks * 512 >= info.file_size
    real_write, calls = os.write, [0]

    def write(fd, data):
        calls[0] += 1
        if calls[0] == 2:  # the header went first: now the tensor's first piece
            src[-1] ^= 0xFF  # a process writes on into the slot after COMMIT
        return real_write(fd, data)

    monkeypatch.setattr(blobfile.os, "write", write)
    other = tmp_path / "cd" / "blob.safetensors"
    with pytest.raises(blobfile.Altered):
        blobfile.write_blob(other, entry)
    monkeypatch.undo()
    assert os.listdir(other.parent) == []


def test_sync_group_waits_for_fsyncs_already_begun(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    entry = make_entry(3)
    paths = [tmp_path / "ab" / f"{i}.safetensors" for i in range(3)]
    with ThreadPoolExecutor(2) as pool:
        started = {}
        for p in paths:
            blobfile.write_blob(p, entry, durable=False)
            started[p] = blobfile.start_sync(p, pool)
        failed = blobfile.sync_group(paths, {tmp_path / "ab"}, pool, started)
    assert failed == {} and all(started[p].done() and started[p].exception() is None for p in paths)


# -- read_to_slots: a blob file read through a private bounce buffer into shared memory


class _Slot(np.ndarray):
    """What the arena hands out (kvd.server.shm's SlotArray): writable bytes whose slices take a digest."""

    digest: int | None = None

    def __array_finalize__(self, obj):
        self.digest = None


class _Slots:
    """An allocator of `_Slot`s that keeps what it handed out (None once `room` is spent)."""

    def __init__(self, room: int = 1 << 40):
        self.room, self.given = room, []

    def __call__(self, nbytes: int):
        if nbytes > self.room:
            return None
        self.room -= nbytes
        self.given.append(np.full(nbytes, 0xEE, np.uint8).view(_Slot))  # not zeros: every byte must be written
        return self.given[-1]


def _big_entry(i: int) -> Entry:
    """Tensors of several sizes, none a multiple of the bounce buffer or the
    slot alignment, one empty: 2.6 MiB in all, across three bounce buffers."""
    rng = np.random.default_rng(i)
    shapes = {"k": ("bfloat16", (2, 300, 1001)), "empty": ("float32", (2, 0, 8)), "v": ("bfloat16", (2, 300, 1001)),
              "odd": ("uint8", (3, 7, 13)), "s": ("int32", (1,))}
    tensors = tuple(Tensor(n, dt, sh, rng.bytes(int(np.prod(sh)) * dtypes.itemsize(dt))) for n, (dt, sh) in shapes.items())
    e = make_entry(i)
    return Entry(e.namespace, e.key, e.kind, e.parent, e.start, e.length, tensors, meta=e.meta)


def _read_to_slots(path, info, slots):
    fd = os.open(path, os.O_RDONLY)
    try:
        return blobfile.read_to_slots(fd, info.file_size, info.checksum, slots)
    finally:
        os.close(fd)


@pytest.mark.parametrize("preadv", [True, False])
def test_a_blob_read_to_slots_is_bit_exact_each_tensor_aligned_with_its_digest(tmp_path, monkeypatch, preadv):
    """(Without os.preadv too: Python on macOS before 11 has none.)"""
    from kvd.protocol.shm import ALIGN

    if not preadv:
        monkeypatch.delattr(os, "preadv", raising=False)

    entry = _big_entry(1)
    path, info = _write(tmp_path, entry)
    assert info.file_size > 2 * blobfile._BOUNCE_BYTES
    slots = _Slots()
    got = _read_to_slots(path, info, slots)
    assert_same(got, entry)
    assert len(slots.given) == 1  # one slot for the entry
    base = slots.given[0].__array_interface__["data"][0]
    for t, want in zip(got.tensors, entry.tensors):
        assert isinstance(t.data, _Slot) and (not t.data.nbytes or np.shares_memory(t.data, slots.given[0]))
        assert (t.data.__array_interface__["data"][0] - base) % ALIGN == 0
        assert t.data.digest == xxhash.xxh3_64_intdigest(want.data)


def test_a_blob_read_to_slots_is_checked_and_small_or_unslotted_ones_go_to_the_heap(tmp_path):
    entry = _big_entry(2)
    path, info = _write(tmp_path, entry)
    assert _read_to_slots(path, info, _Slots(room=info.file_size // 2)) is None  # no room: the heap road
    small_path, small = _write(tmp_path / "small", make_entry(3))
    slots = _Slots()
    assert _read_to_slots(small_path, small, slots) is None and not slots.given  # smaller than a bounce buffer
    raw = bytearray(path.read_bytes())
    for at in (len(raw) - 1, len(raw) // 2, 100):  # the data's last byte, a middle one, one in the header
        bad = bytearray(raw)
        bad[at] ^= 0x40
        path.write_bytes(bad)
        with pytest.raises(BlobCorrupt):
            _read_to_slots(path, info, _Slots())
    path.write_bytes(raw[:-1])
    with pytest.raises(BlobCorrupt):
        _read_to_slots(path, info, _Slots())


def test_a_header_whose_tensors_overlap_is_never_given_slots(tmp_path):
    """The header is read before the checksum can pass: a layout no kvd
    writes (tensors overlapping, each the whole data section) would ask for
    a slot of many times the file. It goes to the heap road instead, whose
    checksum refuses it."""
    entry = _big_entry(4)
    path, info = _write(tmp_path, entry)
    raw = path.read_bytes()
    (hlen,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8 : 8 + hlen])
    for name in ("k", "v"):
        header[name]["data_offsets"] = header["k"]["data_offsets"]
    header["__metadata__"]["kvd_order"] = json.dumps(["k", "v"])
    for name in ("empty", "odd", "s"):
        del header[name]
    head = json.dumps(header, separators=(",", ":")).encode()
    lo, hi = header["k"]["data_offsets"]
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + hlen + lo : 8 + hlen + hi])
    slots = _Slots()
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        assert blobfile.read_to_slots(fd, size, info.checksum, slots) is None and not slots.given
        with pytest.raises(BlobCorrupt):
            blobfile.read_blob(fd, size, info.checksum)
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", ['"__metadata__": 1', '"k": {"dtype": "BF16", "shape": [1e999], "data_offsets": [0, 2]}',
                                 '"k": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 1e999]}', None])
def test_a_hostile_header_read_before_its_checksum_is_blob_corrupt(tmp_path, bad):
    """read_to_slots parses the header before the file's checksum can pass:
    whatever it holds is BlobCorrupt (a miss, the blob quarantined), never
    another exception (INTERNAL, on every GET of it); a header of more than
    1 MiB is not parsed there at all (the heap road's checksum refuses it)."""
    entry = _big_entry(5)
    path, info = _write(tmp_path, entry)
    raw = path.read_bytes()
    (hlen,) = struct.unpack_from("<Q", raw, 0)
    if bad is None:
        head = b"[" * (blobfile._SLOTTED_HEADER + 8)  # deep enough to overflow the parser's stack
    else:
        head = ("{" + bad + "}").encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + hlen :])
    slots = _Slots()
    got = None
    try:
        got = _read_to_slots(path, dataclasses.replace(info, file_size=path.stat().st_size), slots)
    except BlobCorrupt:
        pass
    assert got is None and not slots.given
