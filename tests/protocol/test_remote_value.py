"""The remote tier's layout (sans-I/O): golden vectors, every-bit corruption,
fuzzing, and the remote_url forms and their redaction. No server needed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.config import BY_NAME, ConfigError, resolve
from kvd.protocol import keys
from kvd.protocol import remote_value as rv
from kvd.protocol.codec import Tensor
from kvd.store.remote import url as remote_url

from support import REPO

VECTORS = REPO / "proto" / "vectors" / "remote"
NAMES = sorted(p.stem for p in VECTORS.glob("*.hex"))


def load(name: str):
    values = [bytes.fromhex(line) for line in (VECTORS / f"{name}.hex").read_text().splitlines()]
    return values, json.loads((VECTORS / f"{name}.json").read_text())


AUTH = rv.RemoteKey(bytes(range(32)))  # the vectors' secret (proto/vectors/generate.py)
OTHER = rv.RemoteKey(bytes(32))


def entry_of(twin: dict) -> rv.RemoteEntry:
    e = twin["entry"]
    return rv.RemoteEntry(
        e["namespace"], bytes.fromhex(e["key"]), e["kind"], bytes.fromhex(e["parent"]), e["start"], e["length"],
        tuple(Tensor(t["name"], t["dtype"], tuple(t["shape"]), bytes.fromhex(t["bytes"])) for t in e["tensors"]),
        bytes.fromhex(e["meta"]), e["tail"],
    )


def test_vectors_exist():
    assert {"remote_chunk", "remote_boundary", "remote_split"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_vector_encodes_byte_for_byte_and_decodes_to_its_entry(name):
    values, twin = load(name)
    want = entry_of(twin)
    e = twin["entry"]
    # the key is the chain key of the twin's tokens (section 4), the remote key its hex
    assert want.key == keys.chain(e["namespace"], e["chunk_tokens"], keys.token_bytes(e["tokens"]))[-1]
    main = rv.value_key(want.key, want.kind)
    assert [main.decode()] + [rv.part_key(main, i).decode() for i in range(1, len(values))] == twin["keys"]
    assert rv.RemoteKey.from_text(twin["secret"]).fingerprint == AUTH.fingerprint
    assert rv.encode(want, twin["part_bytes"], AUTH) == values
    head = rv.read_head(values[0])
    assert (head.tag.hex(), head.mac.hex(), head.parts) == (twin["key_tag"], twin["mac"], len(values))
    assert rv.vouched(values[0][: rv.PRESENCE_BYTES], want.key, want.kind, AUTH)
    if twin["tails_value"] is not None:
        assert AUTH.tail_value(want.parent, want.key, want.length).decode() == twin["tails_value"]
    got = rv.decode(head, values[1:], key=want.key, kind=want.kind, auth=AUTH)
    assert [(t.name, t.dtype, t.shape, bytes(t.data)) for t in got.tensors] == [
        (t.name, t.dtype, t.shape, bytes(t.data)) for t in want.tensors
    ]
    assert (got.namespace, got.parent, got.start, got.length, got.meta, got.tail) == (
        want.namespace, want.parent, want.start, want.length, want.meta, want.tail,
    )


@pytest.mark.parametrize("name", NAMES)
def test_every_flipped_bit_missing_part_or_wrong_key_is_refused(name):
    values, twin = load(name)
    want = entry_of(twin)

    def check(vals, key=want.key, kind=want.kind, auth=AUTH):
        with pytest.raises(rv.BadRemoteValue):
            rv.decode(rv.read_head(vals[0]), vals[1:], key=key, kind=kind, auth=auth)

    for v in range(len(values)):
        for i in range(len(values[v])):
            for bit in (0, 7):
                bad = list(values)
                b = bytearray(bad[v])
                b[i] ^= 1 << bit
                bad[v] = bytes(b)
                check(bad)
    if len(values) > 1:
        with pytest.raises(rv.BadRemoteValue):
            rv.decode(rv.read_head(values[0]), [None] * (len(values) - 1), key=want.key, kind=want.kind, auth=AUTH)
        check(values[:-1] + [values[-1] + b"x"])
    check(values, key=b"\0" * 32)
    check(values, kind=1 - want.kind)
    check(values, auth=OTHER)  # a daemon with another key


@pytest.mark.parametrize("name", NAMES)
def test_a_value_written_without_the_secret_is_forged(name):
    """What a third party with write access to the server can do, knowing the
    layout: re-sign with another key, copy a genuine value (or just its tag)
    under another key, swap the header, keep the tag and change the payload."""
    values, twin = load(name)
    want = entry_of(twin)

    def forged(vals, key=want.key, kind=want.kind):
        with pytest.raises(rv.ForgedRemoteValue):
            rv.decode(rv.read_head(vals[0]), vals[1:], key=key, kind=kind, auth=AUTH)
        assert not rv.vouched(vals[0][: rv.PRESENCE_BYTES], key, kind, AUTH) or key == want.key

    planted = rv.encode(want, twin["part_bytes"], OTHER)
    forged(planted)
    assert not rv.vouched(planted[0], want.key, want.kind, AUTH)
    # the same entry relabelled as another one, re-encoded by someone without the secret
    other_key = keys.chain(twin["entry"]["namespace"], twin["entry"]["chunk_tokens"], keys.token_bytes([7, 7, 7]))[-1]
    relabelled = rv.RemoteEntry(want.namespace, other_key, want.kind, want.parent, want.start, want.length,
                                want.tensors, want.meta, want.tail)
    forged(rv.encode(relabelled, twin["part_bytes"], OTHER), key=other_key)
    forged(values, key=other_key)  # a genuine value copied under another key: its tag is its own key's
    # genuine tag and header, another payload (the header's lengths kept)
    first = bytearray(values[0])
    first[-1] ^= 0xFF
    forged([bytes(first)] + values[1:])
    # a genuine prefix (magic, tag) and MAC in front of another header of the same length
    head = rv.read_head(values[0])
    swapped = rv.encode(rv.RemoteEntry(want.namespace, want.key, want.kind, want.parent, want.start, want.length,
                                       want.tensors, b"\x01" * len(want.meta) if want.meta else want.meta,
                                       want.tail), twin["part_bytes"], OTHER)
    if want.meta:
        fixed = len(values[0]) - len(head.header) - len(head.body)
        forged([values[0][:fixed] + swapped[0][fixed:]] + values[1:])


def test_tails_values_vouch_only_for_what_the_secret_signed():
    parent, tail = b"p" * 32, b"t" * 32
    value = AUTH.tail_value(parent, tail, 7)
    assert AUTH.tail_length(parent, tail.hex().encode(), value) == 7
    assert AUTH.tail_length(b"q" * 32, tail.hex().encode(), value) is None  # under another parent
    assert AUTH.tail_length(parent, (b"u" * 32).hex().encode(), value) is None  # for another tail
    assert AUTH.tail_length(parent, tail.hex().encode(), value.replace(b"7:", b"8:", 1)) is None
    assert OTHER.tail_length(parent, tail.hex().encode(), value) is None
    for junk in (b"7", b"", b"x:y", b"-7:" + value.split(b":")[1], b"07:" + value.split(b":")[1]):
        assert AUTH.tail_length(parent, tail.hex().encode(), junk) is None
    assert AUTH.tail_length(parent, b"zz", value) is None


def test_a_key_file_is_64_hex_digits():
    assert rv.RemoteKey.from_text("00" * 32 + "\n").fingerprint == OTHER.fingerprint
    for bad in ("", "00" * 31, "00" * 33, "zz" * 32, "00" * 16 + " " + "00" * 16):
        with pytest.raises(ValueError):
            rv.RemoteKey.from_text(bad)
    assert AUTH.fingerprint != OTHER.fingerprint and "000102" not in repr(AUTH)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.lists(st.binary(max_size=64), max_size=3))
def test_garbage_is_refused_with_the_one_error(data, parts):
    try:
        head = rv.read_head(data)
        rv.decode(head, parts, key=b"k" * 32, kind=0, auth=AUTH)
        raise AssertionError("garbage passed the MAC")
    except rv.BadRemoteValue:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2000), st.integers(1, 700))
def test_any_size_splits_into_parts_and_joins_back(size, part_bytes):
    data = bytes(i % 256 for i in range(size))
    e = rv.RemoteEntry("ns", b"k" * 32, 0, b"p" * 32, 0, 4, (Tensor("t", "uint8", (size,), data),))
    values = rv.encode(e, part_bytes, AUTH)
    used = max(part_bytes, -(-size // rv.MAX_PARTS))  # raised where the entry would need too many parts
    assert len(values) == max(1, -(-size // used)) <= rv.MAX_PARTS
    head = rv.read_head(values[0])
    assert head.part_lengths() == [len(v) for v in values[1:]]  # what a reader asks each part to be
    got = rv.decode(head, values[1:], key=b"k" * 32, kind=0, auth=AUTH)
    assert bytes(got.tensors[0].data) == data


def _planted(size: int, parts: int, part_bytes: int) -> bytes:
    """A main value whose header passes every field check, with what a hostile writer chooses."""
    import struct

    import msgpack

    header = msgpack.packb({
        "v": 2, "ns": "ns", "key": b"k" * 32, "kind": 0, "parent": b"p" * 32, "start": 0, "length": 4,
        "tail": False, "meta": b"", "tensors": [["x", "uint8", [size]]], "size": size, "parts": parts,
        "part_bytes": part_bytes,
    }, use_bin_type=True)
    return struct.pack("<4sI16s32s", b"KVR2", len(header), bytes(16), bytes(32)) + header + b"\0"


def test_a_header_promising_too_much_is_refused_before_any_part_is_asked_for():
    # a million one-byte parts: refused from the header alone
    with pytest.raises(rv.BadRemoteValue, match="parts is over"):
        rv.read_head(_planted(1 << 20, 1 << 20, 1))
    assert rv.read_head(_planted(rv.MAX_PARTS, rv.MAX_PARTS, 1)).parts == rv.MAX_PARTS
    # more payload than the reader takes, however it is split
    big = 600 << 20
    with pytest.raises(rv.BadRemoteValue, match="over the largest entry"):
        rv.read_head(_planted(big, 1, big), max_size=512 << 20)
    assert rv.read_head(_planted(big, 1, big)).size == big  # no bound given: the field checks alone
    # each part's exact length, so a reply of another length is refused from its "$n" line
    assert rv.read_head(_planted(10, 4, 3)).part_lengths() == [3, 3, 1]
    assert rv.max_main_bytes(100) == 56 + rv.MAX_HEADER_BYTES + 100


# -- remote_url -------------------------------------------------------------------


@pytest.mark.parametrize("url, client", [
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("rediss://u:p@h:6380", "rediss://u:p@h:6380"),
    ("valkey://h:6379", "redis://h:6379"),
    ("valkeys://u:p@h/1?ssl_cert_reqs=required", "rediss://u:p@h/1?ssl_cert_reqs=required"),
    ("unix:///p", "unix:///p"),  # an empty host part keeps its "//": redis-py refuses "unix:/p"
    ("unix://default:p@/run/redis.sock?db=1", "unix://default:p@/run/redis.sock?db=1"),
    ("VALKEY://h", "redis://h"),
])
def test_url_forms_map_to_the_client_library(url, client):
    assert remote_url.check(url) == url and remote_url.client_url(url) == client


def test_the_unix_form_opens_a_client_on_that_socket():
    import redis

    pool = redis.Redis.from_url(remote_url.client_url("unix:///run/kvd-test/redis.sock")).connection_pool
    assert pool.connection_kwargs["path"] == "/run/kvd-test/redis.sock"
    assert BY_NAME["remote_url"].shown(resolve({"remote_url": "unix:///p/r.sock"}, environ={}).remote_url) == "unix:///p/r.sock"


@pytest.mark.parametrize("url, shown", [
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://:hunter2@h:6379", "redis://:***@h:6379"),
    ("valkeys://alice:hunter2@h:6380/0", "valkeys://alice:***@h:6380/0"),
    ("redis://hunter2@h", "redis://***@h"),
    ("redis://h/0?password=hunter2&ssl_ca_certs=/ca.pem", "redis://h/0?password=***&ssl_ca_certs=/ca.pem"),
    ("unix://default:hunter2@/run/redis.sock", "unix://default:***@/run/redis.sock"),
    ("redis://default:hunter2%23x@h:6379/0", "redis://default:***@h:6379/0"),  # percent-encoded: a valid URL
])
def test_secrets_are_redacted(url, shown):
    assert remote_url.redact(url) == shown
    cfg = resolve({"remote_url": url}, environ={})
    assert cfg.remote_url == url  # the real value, for the client
    assert "hunter2" not in repr(cfg) and BY_NAME["remote_url"].shown(cfg.remote_url) == shown


@pytest.mark.parametrize("bad", ["http://h:1", "redis://", "redis://:pw@h:notaport", "h:6379", "unix://", "x:pw@h"])
def test_bad_urls_are_config_errors_that_never_echo_the_password(bad):
    with pytest.raises(ConfigError) as info:
        resolve({"remote_url": bad}, environ={})
    assert "pw" not in str(info.value)


@pytest.mark.parametrize("url, secret", [
    ("redis://default:Se#cr3tXYZ@cache-host:6379/0", "cr3tXYZ"),
    ("redis://default:ab/S3cretQQ@cache-host:6379/0", "S3cretQQ"),
    ("redis://default:8841#Zq9-secret@127.0.0.1:1/0", "Zq9-secret"),  # "8841" parses as a port
    ("rediss://alice:a?b@c#d@h/0", "b@c#d"),
    ("valkey://:x/y?z@h", "y?z"),
])
def test_a_password_with_url_delimiters_is_never_shown(url, secret):
    """'#', '/' and '?' end urlsplit's host part early: the password must be
    masked all the same, and the URL refused (it must be percent-encoded)."""
    shown = remote_url.redact(url)
    assert secret not in shown and "***@" in shown
    with pytest.raises(ConfigError) as info:
        resolve({"remote_url": url}, environ={})
    assert secret not in str(info.value) and "percent-encoded" in str(info.value)
    assert "cache-host" not in str(info.value)  # the URL is not repeated at all


def test_none_turns_the_tier_off():
    assert resolve({"remote_url": "none"}, environ={}).remote_url is None
    assert resolve({}, environ={}).remote_url is None


def test_kvd_serve_refuses_a_bad_remote_url_with_exit_78_without_echoing_it(tmp_path):
    from support import kvd

    out = kvd("serve", "--endpoint", f"ipc://{tmp_path}/k.sock", "--data-dir", "none",
              "--remote-url", "http://user:hunter2@h:1", timeout=60)
    assert out.returncode == 78 and "remote_url" in out.stderr and "hunter2" not in out.stderr + out.stdout
