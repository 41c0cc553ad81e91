"""The test kit: every helper more than one test file uses (no tests here).

- Store level: `FakeClock` for the stores' injectable clocks; `make_entry(i, ns)` builds entries that are a pure function
  of (namespace, i), so a test -- or a parent process checking a killed
  child's data dir -- can rebuild exactly what any stored entry must
  contain; `entry(i, nbytes)` is a small RAM-tier entry; `assert_same` compares two entries byte for byte; `filled_store`
  writes a few entries to a data dir and closes it.
- Client level: `prefix_snapshot(tokens)` is like a real model's cache
  (position t depends only on tokens[:t+1]), `snapshot_for(n)` is random;
  both carry one tensor of every dtype in `ALL_DTYPES` (the whole dtype
  table). `assert_prefix_hit` checks a hit against `prefix_snapshot`.
- Daemon level: `kvd(...)` runs the real CLI; `free_port`, `scrape` (its /metrics); `blobs`, `chunk_blob` find a
  daemon's files; `wait_spilled` waits for its SSD tier to hold n entries;
  `no_more_threads(pid)` puts a process under a pids cgroup limit it is at.

The daemon processes themselves are fixtures in conftest.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from kvd.protocol import dtypes, keys
from kvd.store.base import CHUNK, Entry, Tensor
from kvd.store.datadir import BLOB_DIR
from kvd_client import HostTensor, Snapshot

# The checkout and its tests/ folder (the helpers' home, put on a child
# process's sys.path so it can import them), wherever a test file sits below.
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

ALL_DTYPES = list(dtypes.DTYPES)
# Last axis of the client-level snapshots: one tensor per dtype of the whole
# table, about 280 bytes per token in all (the daemon tests' budgets assume it).
WIDTH = 3
ROOT = b"\0" * 32


def key_of(ns: str, i: int) -> bytes:
    return hashlib.blake2b(f"{ns}:{i}".encode(), digest_size=32).digest()


def tensor_bytes(dtype: str, shape: tuple[int, ...], seed: int) -> bytes:
    n = int(np.prod(shape)) * dtypes.itemsize(dtype)
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=n, dtype=np.uint8).tobytes()
    return rng.bytes(n)


def make_entry(
    i: int,
    ns: str = "ns",
    *,
    tokens: int = 16,
    width: int = 64,
    dtype_list: list[str] | None = None,
    kind: int = CHUNK,
    tail: bool = False,
    parent: bytes | None = None,
) -> Entry:
    """A chunk with one tensor per dtype in `dtype_list` (default bf16 k/v)."""
    dtype_list = dtype_list or ["bfloat16", "bfloat16"]
    tensors = []
    for j, dt in enumerate(dtype_list):
        shape = (2, tokens, width)
        tensors.append(Tensor(f"t{j}.{dt}", dt, shape, tensor_bytes(dt, shape, i * 1000 + j)))
    return Entry(
        namespace=ns,
        key=key_of(ns, i),
        kind=kind,
        parent=parent if parent is not None else (key_of(ns, i - 1) if i else ROOT),
        start=i * tokens,
        length=tokens,
        tensors=tuple(tensors),
        meta=b"\x81\xa4meta" + i.to_bytes(4, "little"),
        tail=tail,
    )


def assert_same(got: Entry | None, want: Entry) -> None:
    assert got is not None, f"missing entry {want.key.hex()[:12]}"
    assert (got.namespace, got.key, got.kind, got.parent, got.start, got.length, got.tail, got.meta) == (
        want.namespace, want.key, want.kind, want.parent, want.start, want.length, want.tail, want.meta
    )
    assert got.nbytes == want.nbytes
    assert [(t.name, t.dtype, tuple(t.shape)) for t in got.tensors] == [
        (t.name, t.dtype, tuple(t.shape)) for t in want.tensors
    ]
    for a, b in zip(got.tensors, want.tensors):
        assert bytes(memoryview(a.data)) == bytes(memoryview(b.data)), f"tensor {a.name} differs"


def filled_store(root, entries: list[Entry], *, pack_max_bytes: int = 0) -> list[Entry]:
    """Write `entries` to the data dir `root` (RAM tier of 1 byte: all spill), close it.
    Each blob its own file unless `pack_max_bytes` (tests that damage files need files)."""
    from kvd.store.tiered import open_store

    store = open_store(1, root, ssd_bytes=64 << 20, min_free_bytes=0, pack_max_bytes=pack_max_bytes)
    for e in entries:
        store.put(e)
    store.close()
    return entries


class FakeClock:
    """An injectable clock (`SsdStore(clock=...)`, `open_store(..., clock=...)`):
    time moves only when a test says so."""

    def __init__(self, start: float | None = None):
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def entry(i: int, nbytes: int = 100, ns: str = "a", kind: int = CHUNK, tail: bool = False, parent: bytes = b"p" * 32) -> Entry:
    """A small entry of `nbytes` zero bytes, keyed by `i` (the RAM tier's tests)."""
    key = i.to_bytes(32, "big")
    return Entry(ns, key, kind, parent, 0, 10, (Tensor("t", "uint8", (nbytes,), b"\x00" * nbytes),), tail=tail)


# -- client level --------------------------------------------------------------


def random_tensor(dtype: str, shape, seed: int) -> HostTensor:
    raw = np.frombuffer(tensor_bytes(dtype, tuple(shape), seed), dtype=np.uint8)
    return HostTensor(dtype, raw.view(dtypes.container(dtype)).reshape(shape))


def snapshot_for(n_tokens: int, seed: int = 0, boundary: bool = False) -> Snapshot:
    sliced = {f"t.{dt}": (random_tensor(dt, (1, 2, n_tokens, WIDTH), seed + i), 2) for i, dt in enumerate(ALL_DTYPES)}
    bound = {"state": random_tensor("float32", (1, 4, 4), seed + 99)} if boundary else {}
    return Snapshot(sliced=sliced, boundary=bound, meta={"layout": "test"}, boundary_meta={"at": n_tokens})


def prefix_snapshot(tokens, boundary: bool = False) -> Snapshot:
    """Like a real model's cache: position t's data depends only on tokens[:t+1],
    so two sequences sharing a prefix have identical data over it."""
    toks = np.asarray(tokens, dtype=np.uint64)
    sig = np.cumsum((toks + np.uint64(1)) * (np.arange(len(toks), dtype=np.uint64) + np.uint64(7919)), dtype=np.uint64)
    sliced = {}
    for i, dt in enumerate(ALL_DTYPES):
        width = WIDTH * dtypes.itemsize(dt)
        mult = (np.arange(2 * width, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(i + 1)).reshape(2, width)
        raw = ((sig[None, :, None] * mult[:, None, :]) >> np.uint64(17)).astype(np.uint8)  # (2, T, width)
        if dt == "bool":
            raw &= 1  # a bool byte is 0 or 1
        arr = np.ascontiguousarray(raw[None]).view(dtypes.container(dt))  # (1, 2, T, WIDTH)
        sliced[f"t.{dt}"] = (HostTensor(dt, arr), 2)
    bound = {"state": HostTensor.from_numpy(np.array([int(sig[-1] % 1000)], dtype=np.int32))} if boundary else {}
    return Snapshot(sliced=sliced, boundary=bound, meta={"layout": "test"})


def wide_snapshot(tokens, width: int = 2048) -> Snapshot:
    """Like `prefix_snapshot`, one bf16 tensor of `width` a token and side: a
    256-token chunk is 2 MiB, a blob file the SSD tier reads back through its
    bounce buffer (kvd.store.ssd.blobfile.read_to_slots)."""
    toks = np.asarray(tokens, dtype=np.uint64)
    sig = np.cumsum((toks + np.uint64(1)) * (np.arange(len(toks), dtype=np.uint64) + np.uint64(7919)), dtype=np.uint64)
    mult = (np.arange(2 * width, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(1)).reshape(2, width)
    raw = ((sig[None, :, None] * mult[:, None, :]) >> np.uint64(13)).astype(np.uint16)  # (2, T, width)
    arr = np.ascontiguousarray(raw[None])  # (1, 2, T, width)
    return Snapshot(sliced={"t.bfloat16": (HostTensor("bfloat16", arr), 2)}, boundary={}, meta={"layout": "wide"})


def assert_wide_hit(hit, tokens) -> None:
    want = wide_snapshot(tokens[: hit.n]).sliced["t.bfloat16"][0]
    assert hit.sliced["t.bfloat16"].array.tobytes() == want.array.tobytes()


def assert_prefix_hit(hit, tokens) -> None:
    want = prefix_snapshot(tokens[: hit.n])
    for name, (t, _) in want.sliced.items():
        assert hit.sliced[name].dtype == t.dtype
        assert hit.sliced[name].array.tobytes() == t.array.tobytes(), name


# -- daemon level --------------------------------------------------------------


def kvd(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
        timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the real `kvd` CLI in a child process; its completed process (text output).
    Like the daemon fixtures, it never sees this process's `KVD_*` variables: a test
    sets the ones it means in `env` (which is added to the rest of the environment).
    `prefix` runs it under another command (`setpriv ...`)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    return subprocess.run([*prefix, sys.executable, "-m", "kvd", *args], capture_output=True, text=True,
                          timeout=timeout, env={**clean, **(env or {})})


def blobs(data_dir: Path) -> list[Path]:
    return sorted(p for p in (data_dir / BLOB_DIR).rglob("*.safetensors"))


def chunk_blob(data_dir: Path, ns: str, tokens, index: int) -> Path:
    """The blob file of chunk `index` of `tokens` in namespace `ns` (256-token chunks)."""
    key = keys.chain(ns, 256, keys.token_bytes(tokens))[index]
    (path,) = [p for p in blobs(data_dir) if p.name.startswith(key.hex() + "00")]
    return path


def wait_until(predicate, timeout: float = 20.0, what="condition", every: float = 0.02):
    """Poll `predicate` until it returns something truthy (returned), or fail
    after `timeout` seconds saying `what` (a string, or a callable asked only
    then). For state another thread or process reaches on its own schedule."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(every)


def ask_raw(endpoint: str, frames: list) -> dict:
    """Send hand-made request frames on a fresh DEALER; the reply's fields."""
    import zmq

    from kvd.protocol import codec

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        return codec.decode_reply(sock.recv_multipart()).fields
    finally:
        sock.close()


def wait_spilled(client, n: int, timeout: float = 10.0) -> dict:
    """The SSD tier's stats once it holds at least `n` entries (the daemon's
    writer thread spills on its own schedule), or at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        ssd = client.stats()["tiers"]["ssd"]
        if ssd["entries"] >= n or time.monotonic() > deadline:
            return ssd
        time.sleep(0.05)


@contextlib.contextmanager
def no_more_threads(pid: int):
    """Process `pid` may start no thread while inside (a cgroup v1 pids limit
    at its current count: a host's pids limit, made for real). Skips the test
    where such a cgroup cannot be made (not root, no pids hierarchy)."""
    import pytest

    root = Path("/sys/fs/cgroup/pids")
    if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        pytest.skip("needs a writable cgroup v1 pids hierarchy (root)")
    group = root / f"kvd-test-{os.getpid()}-{pid}"
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(pid))
        (group / "pids.max").write_text((group / "pids.current").read_text())
        yield
    finally:
        try:
            (root / "cgroup.procs").write_text(str(pid))
        except (ProcessLookupError, OSError):
            pass  # it died
        group.rmdir()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """A daemon's /metrics: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def charged(entry) -> int:
    """What `entry` counts against a RAM budget of `open_store` (its bytes and
    the per-entry overhead, kvd/store/overhead.py)."""
    from kvd.store.overhead import entry_overhead

    return entry.nbytes + entry_overhead(entry)


def plain(x):
    """Comparable as data: NaN equals NaN (damaged bytes can decode to one), views are
    bytes; containers keep their type."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x) if type(x) in (list, tuple) else x
    if isinstance(x, memoryview):
        return bytes(x)
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    return x


def numpy_owner(a):
    """The object at the end of `a`'s base chain (through memoryviews): the owner of its memory."""
    while True:
        nxt = a.obj if isinstance(a, memoryview) else a.base
        if nxt is None:
            return a
        a = nxt


def peer_stats(d) -> dict:
    """The `peers` section of a running daemon's STATS, asked by a client of its own."""
    c = d.client("watch", strict=True, timeout=30.0)
    try:
        return c.stats()["peers"]
    finally:
        c.close()


@contextlib.contextmanager
def shm_folder(tmp_path: Path, name: str):
    """A 0700 folder for shared-memory segments, emptied and removed after:
    on tmpfs when there is one (the daemon's own case, and MADV_REMOVE works
    there), else under `tmp_path`."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = base / f"kvd-test-{name}-{os.getpid()}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        for p in path.iterdir():
            p.unlink()
        path.rmdir()
