"""The real client against a daemon that misbehaves on purpose.

The README promises that a model server survives a daemon that is down, slow,
restarting or misbehaving: a miss (None / False / a probe of 0) in the default
mode, a typed KvdError in strict mode -- never a hang past the timeout, an
untyped exception, unbounded memory or wrong bytes. The daemon here is a raw
ZeroMQ ROUTER in a thread, on a throwaway ipc endpoint, answering each request
with whatever a test's handler returns: no kvd code on that side, so it can
break every rule of proto/PROTOCOL.md. Each test pins one defect a red-team
pass found (the numbers are theirs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from kvd_client import BadReply, Client, DaemonUnavailable, HostTensor, Snapshot

RUN = "0123abcd"
L = 8  # tokens of every sequence here; one chunk
TOKENS = list(range(L))
DATA = bytes(range(64))  # float16 (8, 4): 64 bytes


def _reply(mtype: str, rid: int, *frames: bytes, **fields) -> list[bytes]:
    return [msgpack.packb({"v": 1, "type": mtype, "id": rid, **fields}, use_bin_type=True), *frames]


def _meta(**axes) -> bytes:
    return msgpack.packb({"v": 1, "axes": axes, "meta": {}}, use_bin_type=True)


def _tensor(where, name="k", shape=(L, 4)) -> dict:
    """A float16 tensor of a GET reply: in frame `where` (an int) or at descriptor `where` (a list)."""
    return {"name": name, "dtype": "float16", "shape": list(shape), **({"shm": where} if isinstance(where, list) else {"frame": where})}


def _chunk(where=1, start=0, length=L) -> dict:
    return {"start": start, "length": length, "tensors": [_tensor(where)], "meta": _meta(k=0)}


class FakeDaemon:
    """A raw ROUTER answering `handler(header, frames)` -> list of replies (each a list of frames)."""

    def __init__(self, handler, *, limits: dict | None = None, shm: dict | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="kvdh-", dir="/tmp"))  # 0700; short enough for ipc
        self.endpoint = f"ipc://{self.dir}/kvd.sock"
        self.handler, self.limits, self.shm = handler, limits or {}, shm
        self.seen: list[dict] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def hello(self, rid: int) -> list[bytes]:
        fields = {"version": 1, "server": "fake", "limits": self.limits, "chunk_tokens": 256,
                  "features": ["shm"] if self.shm else []}
        if self.shm is not None:
            fields["shm"] = self.shm
        return _reply("HELLO", rid, **fields)

    def count(self, mtype: str) -> int:
        return sum(1 for h in self.seen if h.get("type") == mtype)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, *frames = self._sock.recv_multipart()
            header = msgpack.unpackb(frames[0], raw=False)
            self.seen.append(header)
            if header["type"] == "HELLO":
                replies = [self.hello(header["id"])]
            else:
                replies = self.handler(header, frames[1:]) or []
            for r in replies:
                self._sock.send_multipart([ident, *r], copy=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def fakes():
    made: list[FakeDaemon] = []
    clients: list[Client] = []

    def make(handler, *, client: dict | None = None, **kw) -> tuple[FakeDaemon, Client]:
        f = FakeDaemon(handler, **kw)
        made.append(f)
        c = Client(f.endpoint, namespace="hostile", **{"timeout": 1.0, "transport": "frames", **(client or {})})
        clients.append(c)
        return f, c

    yield make
    for c in clients:
        c.close()
    for f in made:
        f.close()


def _plane(*, nonce: str = "file", segment: str = "file", size: int = 4096) -> Path:
    """A 0700 shared-memory folder as a daemon of run RUN would leave it."""
    d = Path(tempfile.mkdtemp(prefix="kvdh-shm-", dir="/tmp"))
    if nonce == "fifo":
        os.mkfifo(d / "nonce", 0o600)
    else:
        (d / "nonce").write_bytes(os.urandom(32))
    seg = d / f"kvd-{RUN}-0"
    if segment == "dir":
        seg.mkdir()
    elif segment == "empty":
        seg.touch()
    else:
        with open(seg, "wb") as f:
            f.truncate(size)
    return d


@pytest.fixture
def plane():
    made: list[Path] = []

    def make(**kw) -> Path:
        made.append(_plane(**kw))
        return made[-1]

    yield make
    for d in made:
        if (d / "nonce").is_fifo():  # an old client blocked opening it for reading: let it go
            try:
                os.close(os.open(d / "nonce", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        shutil.rmtree(d, ignore_errors=True)


def _offer(d: Path, **over) -> dict:
    return {"dir": str(d), "run": RUN, "lease_s": 5.0, **over}


def _frames_get(h, frames):
    """A well-formed one-page GET reply over frames (LOOKUP says it holds all)."""
    if h["type"] == "GET":
        return [_reply("GET", h["id"], DATA, n=L, end=L, chunks=[_chunk(1)])]
    if h["type"] == "LOOKUP":
        return [_reply("LOOKUP", h["id"], n=0, boundaries=[])]
    return [_reply("ERROR", h["id"], code=500, name="INTERNAL", message="not here")]


def _exact(hit) -> bool:
    return hit is not None and hit.n == L and hit.sliced["k"].array.tobytes() == DATA


# -- 1. a FIFO for a nonce -------------------------------------------------------


def test_a_fifo_nonce_falls_back_to_frames_instead_of_hanging(fakes, plane):
    d = plane(nonce="fifo")
    _, c = fakes(_frames_get, shm=_offer(d), client={"transport": "auto"})
    out: list = []
    t = threading.Thread(target=lambda: out.append(c.get(TOKENS)), daemon=True)
    t.start()
    t.join(5 * c.timeout)  # the old client blocked in open() for ever
    assert not t.is_alive(), "get() hung opening a FIFO nonce"
    assert _exact(out[0]) and c.counters["shm_unavailable"] == 1


# -- 3. descriptors in a reply to a request that offered no shared memory -------


@pytest.mark.parametrize("where", ["chunk", "boundary"])
def test_descriptors_in_a_frames_reply_are_a_miss_or_bad_reply(fakes, where):
    def handler(h, frames):
        if where == "chunk":
            return [_reply("GET", h["id"], n=L, end=L, chunks=[_chunk([0, 0, 64])])]
        boundary = {"at": L, "tensors": [_tensor([0, 0, 64], name="s")], "meta": b""}
        return [_reply("GET", h["id"], DATA, n=L, end=L, chunks=[_chunk(1)], boundary=boundary)]

    f, c = fakes(handler)
    assert c.get(TOKENS) is None
    assert c.counters["get_miss"] == 1 and c.counters["error_bad_reply"] == 1
    _, strict = fakes(handler, client={"strict": True})
    with pytest.raises(BadReply, match="shared memory"):
        strict.get(TOKENS)


# -- 4. boundary state that does not decode -------------------------------------


BOUNDARIES = {
    "meta not msgpack": ({"meta": b"\xc1"}, (8,)),
    "meta a list": ({"meta": msgpack.packb([1, 2])}, (8,)),
    "meta with trailing bytes": ({"meta": msgpack.packb({"meta": {}}) + b"\x00"}, (8,)),
    "meta's meta not a map": ({"meta": msgpack.packb({"meta": [1]})}, (8,)),
    "shape numpy cannot hold": ({"meta": b""}, (2**64 - 1, 0)),
}


@pytest.mark.parametrize("case", list(BOUNDARIES))
def test_boundary_state_that_does_not_decode_is_a_miss(fakes, case):
    extra, shape = BOUNDARIES[case]
    nbytes = int(np.prod(shape, dtype=object)) * 2

    def handler(h, frames):
        boundary = {"at": L, "tensors": [_tensor(2, name="s", shape=shape)], **extra}
        return [_reply("GET", h["id"], DATA, bytes(nbytes), n=L, end=L, chunks=[_chunk(1)], boundary=boundary)]

    _, c = fakes(handler)
    assert c.get(TOKENS) is None
    assert c.counters["get_inconsistent"] == 1 and c.counters["get_hit"] == 0
    _, strict = fakes(handler, client={"strict": True})
    with pytest.raises(ValueError):  # strict: what get_inconsistent raises (tests/client/test_untrusted_replies.py)
        strict.get(TOKENS)


# -- 5. a bad shared-memory offer, bad segments, a bad grant ----------------------


@pytest.mark.parametrize("over", [{"lease_s": "abc"}, {"lease_s": [1]}, {"lease_s": float("inf")},
                                  {"run": "../../x"}, {"run": 7}, {"dir": "relative/path"}, {"dir": None},
                                  {"pid": 1, "pidns": "pid:[1]"}])
def test_a_bad_shm_offer_falls_back_to_frames(fakes, plane, over):
    d = plane()
    _, c = fakes(_frames_get, shm=_offer(d, **over), client={"transport": "auto"})
    assert _exact(c.get(TOKENS))
    assert c.counters["shm_unavailable"] == 1 and c.counters["shm_gets"] == 0


def _shm_get(desc=(0, 0, 64), segments=(0,), lease=1):
    def handler(h, frames):
        if h["type"] != "GET":
            return [_reply("ERROR", h["id"], code=500, name="INTERNAL", message="not here")]
        if "shm" not in h:
            return [_reply("GET", h["id"], DATA, n=L, end=L, chunks=[_chunk(1)])]
        shm = {"run": RUN, "lease_s": 5.0, "segments": list(segments), **({} if lease is None else {"lease": lease})}
        return [_reply("GET", h["id"], n=L, end=L, chunks=[_chunk(list(desc))], shm=shm)]

    return handler


def test_descriptors_no_lease_keeps_are_a_miss_never_views_of_the_segment(fakes, plane):
    """Red-team (session 41): slots named without a lease -- nothing says how
    long their bytes stay -- were served, and boundary state stayed a view of
    the mapping after get() returned."""
    d = plane()
    with open(d / f"kvd-{RUN}-0", "r+b") as f:
        f.write(DATA)
    _, c = fakes(_shm_get(lease=None), shm=_offer(d), client={"transport": "shm"})
    assert c.get(TOKENS) is None and c.counters["get_miss"] == 1 and c.counters["get_failed"] == 1
    _, c = fakes(_shm_get(), shm=_offer(d), client={"transport": "shm"})  # the same with its lease: served
    assert _exact(c.get(TOKENS)) and c.counters["shm_gets"] == 1


@pytest.mark.parametrize("fault", ["empty segment", "segment a directory", "segment index 10**7"])
def test_a_bad_segment_sends_the_call_over_frames(fakes, plane, fault):
    d = plane(segment={"empty segment": "empty", "segment a directory": "dir"}.get(fault, "file"))
    desc = (10**7, 0, 64) if fault == "segment index 10**7" else (0, 0, 64)
    _, c = fakes(_shm_get(desc), shm=_offer(d), client={"transport": "shm"})
    assert _exact(c.get(TOKENS))
    assert c.counters["shm_get_fallback"] == 1 and c.counters["shm_gets"] == 0 and c.counters["get_miss"] == 0


def test_a_segment_list_that_is_not_ids_is_ignored(fakes, plane):
    d = plane()
    with open(d / f"kvd-{RUN}-0", "r+b") as f:
        f.write(DATA)
    _, c = fakes(_shm_get(segments=[[0]]), shm=_offer(d), client={"transport": "shm"})
    assert _exact(c.get(TOKENS)) and c.counters["shm_gets"] == 1


@pytest.mark.parametrize("fault", ["grant in segment 10**7", "grant in an empty segment"])
def test_a_bad_put_grant_is_never_committed_and_the_put_goes_over_frames(fakes, plane, fault):
    d = plane(segment="empty" if "empty" in fault else "file")
    seg = 10**7 if "10**7" in fault else 0

    def handler(h, frames):
        if h["type"] == "LOOKUP":
            return [_reply("LOOKUP", h["id"], n=0, boundaries=[])]
        if h["type"] == "SLOTS":
            return [_reply("SLOTS", h["id"], lease=3, run=RUN, lease_s=5.0, chunks=[[[seg, 0, 64]]], segments=[seg])]
        return [_reply("PUT" if h["type"] in ("PUT", "COMMIT") else "ERROR", h["id"], stored=1, duplicate=0, too_big=0)]

    f, c = fakes(handler, shm=_offer(d), client={"transport": "shm"})
    snap = Snapshot(sliced={"k": (HostTensor.from_numpy(np.ones((L, 4), np.float16)), 0)})
    assert c.put(TOKENS, snap) is True
    assert c.counters["shm_put_abandoned"] == 1 and f.count("COMMIT") == 0 and f.count("PUT") == 1
    # A segment it cannot map: frames for a while, not a grant taken (and lost) at every PUT.
    assert c.put(TOKENS, snap) is True
    assert f.count("SLOTS") == 1 and f.count("PUT") == 2 and c.counters["shm_cooling"] == 1


# -- 6. a descriptor larger than a page may be -----------------------------------


def test_a_page_over_the_advertised_message_limit_is_a_miss(fakes, plane):
    size = 4 << 20  # sparse: costs nothing until read
    d = plane(size=size)

    def handler(h, frames):
        tensor = {"name": "k", "dtype": "float16", "shape": [L, size // (2 * L)], "shm": [0, 0, size]}
        return [_reply("GET", h["id"], n=L, end=L, chunks=[{"start": 0, "length": L, "tensors": [tensor], "meta": _meta(k=0)}],
                       shm={"run": RUN, "lease": 1, "lease_s": 5.0, "segments": [0]})]

    limits = {"max_message_bytes": 1 << 20}
    _, c = fakes(handler, shm=_offer(d), limits=limits, client={"transport": "shm"})
    assert c.get(TOKENS) is None
    assert c.counters["error_bad_reply"] == 1 and c.counters["shm_gets"] == 0
    _, strict = fakes(handler, shm=_offer(d), limits=limits, client={"transport": "shm", "strict": True})
    with pytest.raises(BadReply, match="limit"):
        strict.get(TOKENS)


# -- 7. GET pages that do not advance --------------------------------------------


@pytest.mark.parametrize("page", ["chunk not at start", "end not past start"])
def test_get_pages_that_do_not_advance_are_a_bad_reply(fakes, page):
    def handler(h, frames):
        if page == "chunk not at start":  # end=1 < n, then again a chunk at 0
            return [_reply("GET", h["id"], DATA[:8], n=L, end=1, chunks=[{**_chunk(1, length=1),
                                                                         "tensors": [_tensor(1, shape=(1, 4))]}])]
        return [_reply("GET", h["id"], DATA, n=L, end=0, chunks=[_chunk(1)])]  # end behind its chunk

    f, c = fakes(handler)
    assert c.get(TOKENS) is None
    assert c.counters["error_bad_reply"] == 1 and c.counters["error_out_of_time"] == 0
    assert f.count("GET") == (2 if page == "chunk not at start" else 1)  # the old client asked until its time ran out
    _, strict = fakes(handler, client={"strict": True})
    with pytest.raises(BadReply):
        strict.get(TOKENS)


def test_pages_are_checked_as_they_come_not_hoarded_to_the_end(fakes):
    def handler(h, frames):  # chunks of 2 tokens, one a page; the second of another layout
        start = h["start"]
        width = 4 if start == 0 else 5
        chunk = {"start": start, "length": 2, "tensors": [_tensor(1, shape=(2, width))], "meta": _meta(k=0)}
        return [_reply("GET", h["id"], bytes(4 * width), n=L, end=start + 2, chunks=[chunk])]

    f, c = fakes(handler, client={"chunk_tokens": 2})
    assert c.get(TOKENS) is None
    assert c.counters["get_inconsistent"] == 1
    assert f.count("GET") == 2  # the old client asked for all four pages, then found them inconsistent


# -- 8. the size of what a daemon may send ------------------------------------------


def test_a_frame_over_the_advertised_limit_drops_the_connection(fakes):
    big = bytes(4 << 20)

    def handler(h, frames):
        return [_reply("PING", h["id"], big)]  # 4 MiB, past a 1 MiB daemon's limit

    _, c = fakes(handler, limits={"max_message_bytes": 1 << 20}, client={"strict": True, "timeout": 0.5})
    assert c.hello() is not None
    c.retry_now()  # a connection made after HELLO: under what it advertised
    # ZeroMQ drops the connection on the frame's size, before buffering it; the
    # old client took it in whole, and only the decoder refused it (BadReply).
    with pytest.raises(DaemonUnavailable):
        c.ping()
    sock = c._transport._socket()
    assert sock.getsockopt(zmq.MAXMSGSIZE) <= 3 << 20 and sock.getsockopt(zmq.RCVHWM) <= 4


# -- 10. a reply of very many frames ------------------------------------------------


def test_a_reply_of_more_frames_than_its_header_can_name_is_refused_while_received(fakes):
    many = 40_000  # a 1 MiB header names at most 32,768 frames

    def handler(h, frames):
        return [_reply("PING", h["id"], *([b""] * many))]

    _, c = fakes(handler, limits={"max_header_bytes": 1 << 20}, client={"strict": True})
    assert c.hello() is not None
    # The old client made a zmq.Frame of every part (recv_multipart), then decoded.
    with pytest.raises(BadReply, match="over 32769 frames"):
        c.ping()


# -- 11. a LOOKUP answer that cannot be true ------------------------------------------


@pytest.mark.parametrize("n, boundaries", [(10**12, []), (L, [L, 3]), (4, [6]), (L, [0]), (L, [3, 3])])
def test_a_lookup_answer_past_the_query_is_not_believed(fakes, n, boundaries):
    def handler(h, frames):
        if h["type"] == "LOOKUP":
            return [_reply("LOOKUP", h["id"], n=n, boundaries=boundaries)]
        return [_reply("PUT", h["id"], stored=1, duplicate=0, too_big=0)]

    f, c = fakes(handler)
    assert c.probe(TOKENS) == c.probe(TOKENS[:1]) and c.probe(TOKENS).n == 0
    snap = Snapshot(sliced={"k": (HostTensor.from_numpy(np.ones((L, 4), np.float16)), 0)})
    assert c.put(TOKENS, snap) is True and f.count("PUT") == 1  # the old client sent nothing, and said True
    assert c.counters["put_lookup_unbelieved"] == 1
    _, strict = fakes(handler, client={"strict": True})
    with pytest.raises(BadReply, match="LOOKUP"):
        strict.probe(TOKENS)


# -- stale or unsolicited garbage before the answer ----------------------------------


def test_unsolicited_garbage_does_not_fail_the_next_request(fakes):
    def handler(h, frames):
        junk = _reply("PING", 0, b"unreferenced")  # id 0: no request's; undecodable (a frame no tensor names)
        return [junk, junk, _reply("PING", h["id"])]

    _, c = fakes(handler, client={"strict": True})
    assert c.ping() is not None  # the old client decoded first, and failed on the junk: BadReply
    assert c.ping() is not None
