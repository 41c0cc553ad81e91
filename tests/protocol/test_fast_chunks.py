"""A PUT's chunks, and a GET reply's, are checked by a tight loop
(codec._chunks_fast: issue 44 for a PUT's, issue 42 for a GET reply's) that must
agree with the generic schema walk: the same fields for every valid message,
and for every broken one the generic walk's exact error."""

from __future__ import annotations


import struct

import msgpack
import pytest

from kvd.protocol import codec, keys, skim
from kvd.protocol import errors as E
from kvd.protocol.limits import Limits
from kvd.protocol.shm import Descriptor

LIMITS = Limits(max_meta_bytes=16, max_rank=3)


def put(n: int = 3, tensors: int = 2) -> list:
    chunks = [{"index": i, "tensors": [codec.Tensor(f"t{j}", "float16", (1, 2), bytes(4)) for j in range(tensors)],
               "meta": b"m" * (i % 8)} for i in range(n)]
    return codec.encode("PUT", {"ns": "a", "tokens": keys.token_bytes(range(n)), "chunk_tokens": 1, "chunks": chunks}, id=5)


def generic(frames: list):
    """decode_request with the PUT chunks checked the generic way only."""
    table = {**codec.REQUESTS, "PUT": {**codec.REQUESTS["PUT"], "chunks": codec._req(codec._GENERIC_PUT_CHUNKS)}}
    return codec._decode(frames, table, LIMITS)


def outcome(decode, frames):
    try:
        m = codec.whole(decode(frames))  # a long PUT's chunks: decoded in turns when served, here at once
    except E.ProtocolError as err:
        return type(err), err.message
    return m.type, m.id, m.fields


def fast_calls(decode) -> list:
    """What codec._chunks_fast was asked and gave (None: it left the chunks
    to the generic walk) while `decode()` ran."""
    calls = []
    fast = codec._chunks_fast

    def spy(v, ctx, uints):
        calls.append((uints, fast(v, ctx, uints)))
        return calls[-1][1]

    codec._chunks_fast = spy
    try:
        decode()
    finally:
        codec._chunks_fast = fast
    return calls


def rewrite(frames: list, change) -> list:
    header = msgpack.unpackb(frames[0], raw=False)
    change(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def _set(path, value):
    def change(h):
        obj = h
        for p in path[:-1]:
            obj = obj[p]
        if value is KeyError:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
    return change


CASES = {
    "valid": lambda h: None,
    "no meta": _set(["chunks", 1, "meta"], KeyError),
    "nil meta": _set(["chunks", 1, "meta"], None),
    "meta too long": _set(["chunks", 1, "meta"], b"x" * 17),
    "meta a string": _set(["chunks", 1, "meta"], "x"),
    "index a bool": _set(["chunks", 0, "index"], True),
    "index negative": _set(["chunks", 0, "index"], -1),
    "index missing": _set(["chunks", 2, "index"], KeyError),
    "chunk not a map": _set(["chunks", 1], [1]),
    "chunks not an array": _set(["chunks"], {"a": 1}),
    "tensors not an array": _set(["chunks", 0, "tensors"], 3),
    "tensor not a map": _set(["chunks", 0, "tensors", 0], 3),
    "unknown dtype": _set(["chunks", 1, "tensors", 0, "dtype"], "float7"),
    "rank too high": _set(["chunks", 1, "tensors", 0, "shape"], [1, 1, 1, 2]),
    "negative dim": _set(["chunks", 1, "tensors", 0, "shape"], [-1, 2]),
    "bool dim": _set(["chunks", 1, "tensors", 0, "shape"], [True, 2]),
    "wrong size": _set(["chunks", 1, "tensors", 0, "shape"], [2, 2]),
    "frame out of range": _set(["chunks", 1, "tensors", 0, "frame"], 99),
    "frame a bool": _set(["chunks", 1, "tensors", 0, "frame"], True),
    "frame used twice": _set(["chunks", 1, "tensors", 0, "frame"], 1),
    "frame missing": _set(["chunks", 1, "tensors", 0, "frame"], KeyError),
    "name not a string": _set(["chunks", 1, "tensors", 0, "name"], 7),
    "names repeat": _set(["chunks", 1, "tensors", 1, "name"], "t0"),
    "name is the blob header's": _set(["chunks", 1, "tensors", 0, "name"], "__metadata__"),
    "a frame left over": _set(["chunks", 2, "tensors"], []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fast_check_agrees_with_the_generic_walk(case):
    frames = rewrite(put(), CASES[case])
    fast = outcome(lambda f: codec.decode_request(f, LIMITS), frames)
    assert fast == outcome(generic, frames)
    if case == "valid":
        assert fast[0] == "PUT" and len(fast[2]["chunks"]) == 3
    elif case not in ("no meta", "nil meta"):
        assert issubclass(fast[0], E.ProtocolError)


LONG = 1200  # chunks: a header over skim.SKIM_BYTES with over skim.LAZY_ITEMS of them, left to LazyChunks


@pytest.mark.parametrize("at", [0, 64, LONG - 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_long_puts_chunks_decoded_in_turns_agree_with_the_generic_walk(case, at):
    def change(h):  # the case's damage to chunks at..at+2 of a long PUT (the first batch's, a later one's, the last)
        window = {"chunks": h["chunks"][at : at + 3]}
        CASES[case](window)
        h["chunks"] = h["chunks"][:at] + window["chunks"] + h["chunks"][at + 3 :] if isinstance(window["chunks"], list) else window["chunks"]

    frames = rewrite(put(LONG), change)
    got = outcome(lambda f: codec.decode_request(f, LIMITS), frames)
    assert got == outcome(generic, frames)
    if case == "valid":
        assert isinstance(codec.decode_request(frames, LIMITS).fields["chunks"], codec.LazyChunks)
        assert got[0] == "PUT" and [c["index"] for c in got[2]["chunks"]] == list(range(LONG))
    elif case not in ("no meta", "nil meta", "frame out of range"):  # (99 is a frame of a long PUT)
        assert issubclass(got[0], E.ProtocolError)


def test_a_long_puts_chunks_are_decoded_a_batch_a_step():
    m = codec.decode_request(put(LONG), LIMITS)
    steps, n = m.fields["chunks"].steps(batch=64), 0
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
            n += 1
    assert n == -(-LONG // 64) and [c["index"] for c in done.value.value] == list(range(LONG))


def test_a_long_arrays_items_in_other_fields_and_replies_are_decoded_whole():
    # Only a PUT's chunks are left undecoded: a SLOTS's (specs, no frames) and a GET reply's are lists.
    n = 4 * LONG
    chunks = [{"index": i, "tensors": [codec.Tensor("t", "float16", (1, 2), None)]} for i in range(n)]
    frames = codec.encode("SLOTS", {"ns": "a", "tokens": keys.token_bytes(range(n)), "chunk_tokens": 1, "chunks": chunks, "shm": {}}, id=1)
    assert len(frames[0]) >= skim.SKIM_BYTES
    slots = codec.decode_request(frames, Limits())
    assert type(slots.fields["chunks"]) is list and [c["index"] for c in slots.fields["chunks"]] == list(range(n))


def test_a_put_of_8000_tiny_chunks_decodes_as_the_generic_walk_does():
    # (How much faster the tight loop is, is bench_stress's tiny-flood figure, not a timed test.)
    frames = put(8000, 1)
    lim = Limits()
    table = {**codec.REQUESTS, "PUT": {**codec.REQUESTS["PUT"], "chunks": codec._req(codec._GENERIC_PUT_CHUNKS)}}
    assert outcome(lambda f: codec.decode_request(f, lim), frames) == outcome(lambda f: codec._decode(f, table, lim), frames)


# -- a GET reply's chunks: tensors in frames and in shared memory ---------------


def get_reply(n: int = 3) -> list:
    """A GET reply whose chunks hold a tensor in a frame and two in shared memory (one with a digest)."""
    chunks = [{"start": i, "length": 1, "meta": b"m" * (i % 8), "tensors": [
        codec.Tensor("f", "float16", (1, 2), bytes(4)),
        codec.Tensor("s", "bfloat16", (1, 2), Descriptor(3, 64 * i, 4, 2**64 - 1 - i)),
        codec.Tensor("u", "uint8", (2, 2), Descriptor(4, 128 * i, 4)),
    ]} for i in range(n)]
    return codec.encode("GET", {"n": n, "end": n, "chunks": chunks, "shm": {"run": "r", "lease_s": 1.0}}, id=9)


def generic_reply(frames: list):
    """decode_reply with the GET chunks checked the generic way only."""
    table = {**codec.REPLIES, "GET": {**codec.REPLIES["GET"], "chunks": codec._req(codec._GENERIC_GET_CHUNKS)}}
    return codec._decode(frames, table, LIMITS, shm_ok=True)


REPLY_CASES = {
    **{k: v for k, v in CASES.items() if "index" not in k and k != "names repeat"},
    "start a bool": _set(["chunks", 0, "start"], True),
    "start negative": _set(["chunks", 0, "start"], -1),
    "start missing": _set(["chunks", 2, "start"], KeyError),
    "length a string": _set(["chunks", 1, "length"], "1"),
    "length a float": _set(["chunks", 1, "length"], 1.0),
    "descriptor not an array": _set(["chunks", 1, "tensors", 1, "shm"], {"a": 1}),
    "descriptor of two": _set(["chunks", 1, "tensors", 1, "shm"], [3, 64]),
    "descriptor with a bool": _set(["chunks", 1, "tensors", 1, "shm"], [True, 64, 4]),
    "descriptor offset negative": _set(["chunks", 1, "tensors", 1, "shm"], [3, -64, 4]),
    "descriptor segment a float": _set(["chunks", 1, "tensors", 1, "shm"], [3.0, 64, 4]),
    "descriptor of the wrong length": _set(["chunks", 1, "tensors", 1, "shm"], [3, 64, 8]),
    "descriptor nil": _set(["chunks", 1, "tensors", 1, "shm"], None),
    "digest nil": _set(["chunks", 1, "tensors", 1, "xxh3"], None),
    "digest a string": _set(["chunks", 1, "tensors", 1, "xxh3"], "1"),
    "digest negative": _set(["chunks", 1, "tensors", 1, "xxh3"], -1),
    "digest a bool": _set(["chunks", 1, "tensors", 2, "xxh3"], False),
    "a frame and a descriptor": _set(["chunks", 1, "tensors", 1, "frame"], 2),
    "a frame nil beside a descriptor": _set(["chunks", 1, "tensors", 1, "frame"], None),
    "a shared name": _set(["chunks", 1, "tensors", 2, "name"], "s"),
}


@pytest.mark.parametrize("case", sorted(REPLY_CASES))
def test_the_fast_check_of_a_get_reply_agrees_with_the_generic_walk(case):
    frames = rewrite(get_reply(), REPLY_CASES[case])
    fast = outcome(lambda f: codec.decode_reply(f, LIMITS), frames)
    assert fast == outcome(generic_reply, frames)
    if case in ("valid", "no meta", "nil meta", "a frame nil beside a descriptor"):
        assert fast[0] == "GET"
        t = fast[2]["chunks"][2]["tensors"]
        assert t[0].data == bytes(4) and t[1].data == Descriptor(3, 128, 4, 2**64 - 3) and t[2].data == Descriptor(4, 256, 4)
    else:
        assert issubclass(fast[0], E.ProtocolError)


def test_the_fast_check_of_a_get_reply_is_the_one_taken():
    # (What it saves is bench/probe_fetch.py's `requests` figure, not a timed test.)
    calls = fast_calls(lambda: codec.decode_reply(get_reply(), LIMITS))
    assert len(calls) == 1 and calls[0][0] == ("start", "length") and calls[0][1] is not None and len(calls[0][1]) == 3


def placed_reply(n: int = 3) -> list:
    """A GET reply (section 14, placed chunks): chunk 0's tensors as maps, the
    others placed, in two layouts (the last chunk shorter, as a cache's last is)."""
    layouts = [[["k", "bfloat16", [1, 2]], ["v", "uint8", [2, 2]]], [["k", "bfloat16", [1, 1]], ["v", "uint8", [1, 2]]]]
    chunks = [{"start": 0, "length": 1, "tensors": [
        codec.Tensor("k", "bfloat16", (1, 2), Descriptor(3, 0, 4, 7)), codec.Tensor("v", "uint8", (2, 2), bytes(4))],
        "meta": b"m"}]
    for i in range(1, n):
        last = i == n - 1
        words = [3, 64 * i, 2**64 - i, 4, 128 * i, i]
        chunks.append({"start": i, "length": 1, "layout": int(last),
                       "places": struct.pack("<6Q", *words), "meta": b"m"})
    return codec.encode("GET", {"n": n, "end": n, "layouts": layouts, "chunks": chunks,
                                "shm": {"run": "r", "lease_s": 1.0}}, id=9)


PLACED_CASES = {
    "valid": lambda h: None,
    "layout out of range": _set(["chunks", 1, "layout"], 2),
    "layout a bool": _set(["chunks", 1, "layout"], True),
    "layout negative": _set(["chunks", 1, "layout"], -1),
    "places short": _set(["chunks", 2, "places"], bytes(47)),
    "places long": _set(["chunks", 2, "places"], bytes(49)),
    "places a string": _set(["chunks", 1, "places"], "x" * 48),
    "places missing": _set(["chunks", 1, "places"], KeyError),
    "tensors beside a layout": _set(["chunks", 1, "tensors"], []),
    "no layouts": _set(["layouts"], KeyError),
    "layouts a map": _set(["layouts"], {"0": []}),
    "a layout a map": _set(["layouts", 0], {}),
    "a head of two": _set(["layouts", 0, 1], ["v", "uint8"]),
    "a head a map": _set(["layouts", 0, 1], {"name": "v", "dtype": "uint8", "shape": [2, 2]}),
    "a name twice": _set(["layouts", 0, 1, 0], "k"),
    "a name __metadata__": _set(["layouts", 1, 0, 0], "__metadata__"),
    "a name an int": _set(["layouts", 1, 0, 0], 5),
    "an unknown dtype": _set(["layouts", 0, 0, 1], "float128"),
    "a rank over the limit": _set(["layouts", 0, 0, 2], [1, 1, 1, 2]),
    "a negative dimension": _set(["layouts", 0, 0, 2], [-1, 2]),
    "bytes past 2**64": _set(["layouts", 0, 0, 2], [2**63, 4]),
    "meta too long": _set(["chunks", 1, "meta"], b"m" * 17),
    "start missing": _set(["chunks", 2, "start"], KeyError),
}


@pytest.mark.parametrize("case", sorted(PLACED_CASES))
def test_placed_chunks_decode_as_the_generic_walk_has_them(case):
    frames = rewrite(placed_reply(), PLACED_CASES[case])
    fast = outcome(lambda f: codec.decode_reply(f, LIMITS), frames)
    assert fast == outcome(generic_reply, frames)
    if case != "valid":
        assert issubclass(fast[0], E.ProtocolError), fast
        return
    chunks = fast[2]["chunks"]
    assert [[(t.name, t.dtype, t.shape, t.data) for t in c["tensors"]] for c in chunks[1:]] == [
        [("k", "bfloat16", (1, 2), Descriptor(3, 64, 4, 2**64 - 1)), ("v", "uint8", (2, 2), Descriptor(4, 128, 4, 1))],
        [("k", "bfloat16", (1, 1), Descriptor(3, 128, 2, 2**64 - 2)), ("v", "uint8", (1, 2), Descriptor(4, 256, 2, 2))],
    ]
    assert chunks[0]["tensors"][1].data == bytes(4)
    # Encoded again, placed chunks go as they came: the same bytes.
    again = codec.encode("GET", fast[2], id=9)
    assert [bytes(memoryview(f)) for f in again] == [bytes(memoryview(f)) for f in frames]


def test_placed_chunk_errors_are_exact():
    def code(case):
        try:
            codec.decode_reply(rewrite(placed_reply(), PLACED_CASES[case]), LIMITS)
        except E.ProtocolError as err:
            return type(err).__name__, err.message
    assert code("layout out of range") == ("BadField", "field 'chunks': layout 2 is not one of the reply's 2 layouts")
    assert code("places short") == ("BadField", "field 'chunks': 47 bytes of places for a layout of 2 tensors, expected 48")
    assert code("tensors beside a layout") == ("BadField", "field 'chunks': a chunk has tensors or a layout, not both")
    assert code("no layouts") == ("BadField", "field 'chunks': layout 0 is not one of the reply's 0 layouts")
    assert code("an unknown dtype")[0] == "BadDtype" and code("a rank over the limit")[0] == "BadShape"
    assert code("bytes past 2**64") == ("BadShape", "tensor 'k': bfloat16[9223372036854775808, 4] is more than 2**64 bytes")


def test_placed_tensors_count_against_max_frames():
    """Each placed tensor costs the decoder what a tensor in a frame does:
    at most max_frames of them a reply, in layouts and in chunks alike."""
    tight = Limits(max_meta_bytes=16, max_rank=3, max_frames=5)
    frames = placed_reply(3)  # 4 placed tensors, 4 heads: within 5
    assert codec.decode_reply(frames, tight).type == "GET"
    with pytest.raises(E.BadField, match="chunks place more than 5 tensors"):
        codec.decode_reply(placed_reply(4), tight)  # 6 placed
    big = rewrite(placed_reply(), _set(["layouts", 1], [[f"t{i}", "uint8", [1]] for i in range(4)]))
    with pytest.raises(E.BadField, match="layouts name more than 5 tensors"):
        codec.decode_reply(big, tight)


def test_a_request_cannot_place_tensors():
    """Only replies place tensors: a PUT chunk naming a layout is still a
    chunk without tensors."""
    frames = rewrite(put(), _set(["chunks", 0, "layout"], 0))
    got = {}
    calls = fast_calls(lambda: got.setdefault("msg", codec.decode_request(frames, LIMITS)))
    assert len(got["msg"]["chunks"][0]["tensors"]) == 2  # (an unknown field of a PUT chunk: ignored)
    assert calls and calls[0][1] is not None  # the fast check, not the generic walk: a stray key costs nothing


def test_placed_chunks_take_the_fast_check():
    calls = fast_calls(lambda: codec.decode_reply(placed_reply(), LIMITS))
    assert len(calls) == 1 and calls[0][1] is not None and [len(c["tensors"]) for c in calls[0][1]] == [2, 2, 2]
