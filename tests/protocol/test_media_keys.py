"""Media-aware keys end to end: a real daemon, the numpy client, the mlx client.

The same tokens with another image's digest at the image's positions share
nothing from the image on; the same image shares everything; text before the
image is shared whatever the image; no media gives the keys of kvd/1.0.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.protocol import keys
from kvd_client import HostTensor, MediaSpan, Snapshot, media_digest

CT = 8
TOKENS = list(range(1, 41))  # 5 chunks of 8


def snap(n: int, seed: int) -> Snapshot:
    rng = np.random.default_rng(seed)
    return Snapshot(sliced={"k": (HostTensor.from_numpy(rng.standard_normal((1, 2, n, 4)).astype(np.float32)), 2)})


def image(seed: int) -> bytes:
    return media_digest(np.random.default_rng(seed).integers(0, 255, (2, 16, 16, 3), dtype=np.uint8))


def test_same_image_hits_other_image_misses_text_before_it_is_shared(kvd_daemon):
    img, other = image(1), image(2)
    with kvd_daemon.client("vlm", chunk_tokens=CT, strict=True) as kv:
        span = [MediaSpan(12, 30, img)]
        assert kv.put(TOKENS, snap(40, 0), media=span)
        assert kv.probe(TOKENS, media=span).n == 40
        assert kv.probe(TOKENS, media=[(12, 30, img)]).n == 40  # tuples work too
        # Another image at the same positions: only the chunk before it is shared.
        assert kv.probe(TOKENS, media=[MediaSpan(12, 30, other)]).n == 8
        # The text alone (no media) is another sequence from the image's chunk on.
        assert kv.probe(TOKENS).n == 8
        hit = kv.get(TOKENS, media=span)
        assert hit.n == 40 and np.array_equal(hit.sliced["k"].array, snap(40, 0).sliced["k"][0].array)
        assert kv.get(TOKENS, media=[MediaSpan(12, 30, other)], max_tokens=40).n == 8


def test_explain_keys_media_like_get(kvd_daemon):
    img, other = image(3), image(4)
    with kvd_daemon.client("vlm-explain", chunk_tokens=CT, strict=True) as kv:
        assert kv.put(TOKENS, snap(40, 3), media=[MediaSpan(12, 30, img)])
        held = kv.explain(TOKENS, media=[MediaSpan(12, 30, img)])
        assert (held.n, held.reason) == (40, "held")
        assert kv.explain(TOKENS, media=[MediaSpan(12, 30, other)]).n == 8
        assert kv.explain(TOKENS).n == 8


def test_a_stored_prefix_cut_inside_an_image_is_found_by_the_whole_request(kvd_daemon):
    img = image(3)
    with kvd_daemon.client("vlm", chunk_tokens=CT, strict=True) as kv:
        # A cache of the first 20 tokens, cut in the middle of the image [12, 30).
        assert kv.put(TOKENS[:20], snap(20, 1), media=[MediaSpan(12, 30, img)])
        assert kv.probe(TOKENS, media=[MediaSpan(12, 30, img)]).n == 20
        assert kv.probe(TOKENS, media=[MediaSpan(12, 30, image(4))]).n == 8


def test_no_media_keeps_the_old_keys(kvd_daemon):
    with kvd_daemon.client("vlm", chunk_tokens=CT, strict=True) as kv:
        assert kv.put(TOKENS, snap(40, 2))
        assert kv.probe(TOKENS, media=[]).n == 40
    tb = keys.token_bytes(TOKENS)
    assert keys.chain("vlm", CT, tb, ()) == keys.chain("vlm", CT, tb)


@pytest.mark.parametrize("span", [MediaSpan(30, 50, b"\0" * 32), MediaSpan(5, 5, b"\0" * 32)])
def test_a_span_outside_the_tokens_is_refused_as_bad_field(kvd_daemon, span):
    import zmq

    from kvd.protocol import codec

    with kvd_daemon.client("vlm", chunk_tokens=CT, strict=True) as kv:
        if span.start >= 20:  # the client cuts spans at the tokens: not part of this sequence
            assert kv.probe(TOKENS[:20], media=[span]) == kv.probe(TOKENS[:20])
        else:
            with pytest.raises(ValueError):  # an empty span: the caller's bug
                kv.probe(TOKENS[:20], media=[span])
    # A peer that does not check gets BAD_FIELD, and the daemon goes on serving.
    fields = {"ns": "vlm", "tokens": keys.token_bytes(TOKENS[:20]), "chunk_tokens": CT, "media": [span.to_wire()]}
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kvd_daemon.endpoint)
    try:
        sock.send_multipart(codec.encode("LOOKUP", fields, id=7))
        msg = codec.decode_reply(sock.recv_multipart())
        assert (msg.type, msg["code"], msg["name"]) == ("ERROR", 103, "BAD_FIELD")
    finally:
        sock.close()
    with kvd_daemon.client("vlm", chunk_tokens=CT, strict=True) as kv:
        assert kv.ping() is not None


def test_mlx_fetch_and_store_take_media(kvd_daemon):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    img = image(5)
    c = KVCache()
    k = mx.random.normal((1, 2, 40, 8), key=mx.random.key(0))
    c.update_and_fetch(k, k + 1)
    mx.eval(c.keys)
    with kvd_daemon.client("vlm-mlx", chunk_tokens=CT, strict=True) as kv:
        assert kv.store(TOKENS, [c], media=[MediaSpan(12, 30, img)], wait=True)
        query = TOKENS + [99]
        assert kv.lookup(query, media=[MediaSpan(12, 30, img)]) == 40
        assert kv.lookup(query, media=[MediaSpan(12, 30, image(6))]) == 8
        got, n = kv.fetch(query, media=[MediaSpan(12, 30, img)])
        assert n == 40 and mx.array_equal(got[0].keys[..., :40, :], c.keys[..., :40, :]).item()


def test_a_daemon_without_media_keys_is_never_sent_media(tmp_path):
    """A kvd/1.1 daemon ignores unknown fields: sent `media`, it would match the
    text alone and serve another image's cache. The client asks HELLO for the
    feature and, without it, misses and stores nothing. (An old daemon cannot
    be run here, so a ROUTER socket answers as one would.)"""
    import threading

    import zmq

    from kvd.protocol import codec
    from kvd_client import Client

    endpoint = f"ipc://{tmp_path}/old.sock"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    seen: list[str] = []
    stop = threading.Event()

    def serve():
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            ident, *frames = sock.recv_multipart()
            msg = codec.decode_request(frames)
            seen.append(msg.type)
            fields = {"LOOKUP": {"n": 40, "boundaries": []}, "PING": {},
                      "HELLO": {"version": 1, "server": "kvd/0.0.9", "limits": {}, "chunk_tokens": 256}}[msg.type]
            sock.send_multipart([ident, *codec.encode(msg.type, fields, id=msg.id)])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with Client(endpoint, namespace="vlm", chunk_tokens=CT, timeout=2.0) as kv:
            span = [MediaSpan(12, 30, image(7))]
            assert kv.probe(TOKENS, media=span).n == 0
            assert kv.get(TOKENS, media=span) is None
            assert kv.put(TOKENS, snap(40, 3), media=span) is False
            assert kv.probe(TOKENS).n == 40  # text alone still works with it
            assert kv.counters["media_unsupported"] == 3
        assert seen == ["HELLO", "LOOKUP"]
    finally:
        stop.set()
        t.join(5)
        sock.close()
