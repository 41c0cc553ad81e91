"""The real `kvd` command line meets a daemon whose STATS or GC reply is good
kvd/1 -- a map, in a well-formed message -- with junk inside (a buggy, older
or newer daemon). A field that is merely odd draws as "?" and the view goes
on; a map the view cannot be drawn from is one line, `kvd: the daemon sent a
malformed ... reply (...)`, and exit 1. Never a traceback.

The daemon is a raw ROUTER in a thread, answering HELLO as a daemon does and
STATS and GC with what the test sets.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from pathlib import Path

import msgpack
import pytest
import zmq

from kvd.cli import exits
from support import kvd
from test_cli_errors import assert_one_line_error

HELLO = {"version": 1, "server": "junk", "limits": {}, "chunk_tokens": 256, "features": []}


class JunkDaemon:
    """A ROUTER on a short ipc path answering HELLO properly and STATS/GC with `self.replies[type]`."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="kvd-junk-", dir="/tmp"))  # 0700, short enough for sun_path
        self.endpoint = f"ipc://{self.dir / 'k.sock'}"
        self.replies: dict[str, dict] = {}
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the fake daemon did not bind"

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)  # made, used and closed in this thread only
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                ident, head, *_ = sock.recv_multipart()
                h = msgpack.unpackb(head, raw=False)
                fields = HELLO if h["type"] == "HELLO" else self.replies.get(h["type"])
                if fields is None:
                    fields, h["type"] = {"code": 500, "name": "INTERNAL", "message": "not faked"}, "ERROR"
                sock.send_multipart([ident, msgpack.packb({"v": 1, "type": h["type"], "id": h["id"], **fields},
                                                          use_bin_type=True)])
        finally:
            sock.close(0)
            ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def junk():
    d = JunkDaemon()
    yield d
    d.close()


def kvd_against(d: JunkDaemon, args: tuple[str, ...], stats: dict | None = None, gc: dict | None = None):
    d.replies = {"STATS": {"stats": stats if stats is not None else {}},
                 "GC": {"entries": 1, "bytes": 2, "dry_run": True, **(gc or {})}}
    return kvd(*args, "--endpoint", d.endpoint, "--timeout", "5")


STATS, TOP, LS, GC = ("stats",), ("top", "--count", "1"), ("ls",), ("gc", "--dry-run")

# name: (command, STATS map, GC fields) that no view can be drawn from (the codec
# already refuses a GC reply whose counts or details are of the wrong type)
MALFORMED = {
    "stats: server a number": (STATS, {"server": 5}, None),
    "stats: tiers a list": (STATS, {"tiers": [1, 2]}, None),
    "stats: a tier's entries a list": (STATS, {"tiers": {"ram": {"entries": [1, 2]}}}, None),
    "stats: a namespace a number": (STATS, {"namespaces": {"n": 5}}, None),
    "stats --json: keys str and bytes": (("stats", "--json"), {"server": {b"k": 1, "j": 2}}, None),
    "top: server a number": (TOP, {"server": 5}, None),
    "top: pressure a string": (TOP, {"pressure": "high"}, None),
    "top: a counter a string": (TOP, {"namespaces": {"a": {"gets": "x"}}}, None),
    "ls: namespaces a list": (LS, {"namespaces": [1]}, None),
    "ls: last_used a string": (LS, {"namespaces": {"a": {"entries": 1, "last_used": "x"}}}, None),
    "ls --offline: server a number": (("ls", "--offline"), {"server": 5}, None),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_reply_no_view_can_be_drawn_from_is_one_line_and_exit_1(junk, case):
    args, stats, gc = MALFORMED[case]
    r = kvd_against(junk, args, stats, gc)
    assert_one_line_error(r, exits.FAILED, "the daemon sent a malformed STATS reply")


# name: (command, STATS map, GC fields, what stdout shows) where an odd field is drawn as "?" or printed
ODD = {
    "stats: uptime a string": (STATS, {"server": {"uptime": "long"}}, None, "up ?"),
    "stats: bytes a string": (STATS, {"tiers": {"ram": {"entries": 1, "bytes": "many"}}}, None, "?"),
    "top: an eviction without its fields": (TOP, {"evictions": {"recent": [{"tier": 1}]}}, None, "  ?  1    ?"),
    "top: pressure without its fields": (TOP, {"pressure": {"level": "high"}}, None, "HIGH  (?)"),
    "ls: no namespaces at all": (LS, {}, None, "namespace"),
    "gc: a detail not a map": (GC, None, {"details": {"a": 5, "b": [1]}}, "  a: 5"),
}


@pytest.mark.parametrize("case", ODD)
def test_an_odd_field_is_drawn_as_what_it_is_and_the_view_goes_on(junk, case):
    args, stats, gc, shows = ODD[case]
    r = kvd_against(junk, args, stats, gc)
    assert (r.returncode, r.stderr) == (exits.OK, ""), (r.returncode, r.stderr)
    assert shows in r.stdout, r.stdout


@pytest.mark.parametrize("args, stats, gc, path", [
    (("stats", "--json"), {"server": {"version": b"\xff\x00"}}, None, ("server", "version")),
    (("gc", "--dry-run", "--json"), None, {"details": {"a": {"x": b"\xff\x00"}}}, ("details", "a", "x")),
], ids=["stats", "gc"])
def test_json_shows_bytes_as_their_repr(junk, args, stats, gc, path):
    r = kvd_against(junk, args, stats, gc)
    assert (r.returncode, r.stderr) == (exits.OK, ""), (r.returncode, r.stderr)
    out = json.loads(r.stdout)
    for key in path:
        out = out[key]
    assert out == repr(b"\xff\x00")


@pytest.mark.parametrize("fields", [5, {"a": 5}])
def test_an_explain_detail_no_view_can_be_drawn_from_is_one_line_and_exit_1(junk, tmp_path, fields):
    tokens = tmp_path / "t.txt"
    tokens.write_text("1 2 3")
    junk.replies = {"EXPLAIN": {"n": 0, "tokens": 3, "reason": "miss", "message": "m", "boundaries": [],
                                "detail": {"fields": fields}}}
    r = kvd("explain", "--namespace", "ns", "--tokens-file", str(tokens), "--endpoint", junk.endpoint, "--timeout", "5")
    assert_one_line_error(r, exits.FAILED, "malformed EXPLAIN reply")
