"""What the remote tier serves is what a holder of the shared key stored.

Against a real redis-server and real daemons: a third party with write access
to the server (no kvd key, only the documented layout, PROTOCOL.md section
13) plants values for a stored sequence and for one nobody stored, flips a
payload bit, swaps a header, copies a value under another key, or is a
daemon with another key: every one of them is a miss, counted in
`auth_failures`, never a served byte. A daemon without a key refuses to
start; TLS with a CA file and an ACL user work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvd.protocol import keys
from kvd.protocol import remote_value as rv
from redis_server import SKIP_REASON, RedisServer, redis_binary, session_key, function_server, remote  # noqa: F401 (the fixture "server")
from support import assert_prefix_hit, free_port, kvd, prefix_snapshot, wait_until

pytestmark = pytest.mark.skipif(redis_binary() is None, reason=SKIP_REASON)

NS = "trust-test"
CT = 256  # the daemons' chunk size


def store_and_flush(daemon, tokens, n_entries: int) -> None:
    with daemon.client(NS, strict=True) as c:
        assert c.put(tokens, prefix_snapshot(tokens))
        wait_until(lambda: (lambda r: r["backlog"] == 0 and r["written"] >= n_entries)(remote(c)), what="written")


def chunk_keys(tokens) -> list[bytes]:
    return keys.chain(NS, CT, keys.token_bytes(tokens))


def other_key_file(folder: Path) -> str:
    path = folder / "other.key"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return str(path)


def forge(r, tokens, auth: rv.RemoteKey, *, fill: int) -> None:
    """Write, as a daemon with `auth` would (PROTOCOL section 13), values for
    every whole chunk of `tokens` whose tensors are all `fill` bytes."""
    from kvd.protocol.codec import Tensor

    parent = keys.root_key(NS, CT)
    for i, key in enumerate(chunk_keys(tokens)[: len(tokens) // CT]):
        snap = prefix_snapshot(tokens[: (i + 1) * CT])
        tensors = tuple(
            Tensor(name, ht.dtype, tuple(ht.array[:, :, i * CT:(i + 1) * CT].shape), bytes([fill]) * ht.array[:, :, i * CT:(i + 1) * CT].nbytes)
            for name, (ht, _) in snap.sliced.items()
        )
        entry = rv.RemoteEntry(NS, key, 0, parent, i * CT, CT, tensors, b"")
        values = rv.encode(entry, 32 << 20, auth)
        main = rv.value_key(key, 0)
        for j, part in enumerate(values[1:], 1):
            r.set(rv.part_key(main, j), part)
        r.set(main, values[0])
        parent = key


def test_values_planted_without_the_key_are_never_served(server, daemon_factory, tmp_path):
    a = daemon_factory("--ram-mb", "64", "--remote-url", server.url)
    stored = list(range(1000, 1512))  # two whole chunks
    store_and_flush(a, stored, 2)
    never = list(range(5000, 5512))  # a sequence nobody stored
    attacker = rv.RemoteKey(os.urandom(32))  # knows the layout, not the secret
    r = server.client()
    forge(r, stored, attacker, fill=0xAB)  # overwrites A's genuine values
    forge(r, never, attacker, fill=0xCD)
    b = daemon_factory("--ram-mb", "64", "--remote-url", server.url)
    with b.client(NS, strict=True) as cb:
        assert cb.probe(never).n == 0  # a planted value's key tag is not the secret's
        assert cb.get(never) is None
        # the stored sequence: its genuine values are gone, the planted ones are never served
        assert cb.get(stored) is None
        rb = remote(cb)
        assert rb["hits"] == 0 and rb["auth_failures"] >= 3, rb
        assert rb["key"] == session_key().fingerprint
    assert "not written with this daemon's remote key" in b.log()


def test_a_flipped_bit_a_swapped_header_or_a_copy_under_another_key_is_a_miss(server, daemon_factory):
    a = daemon_factory("--ram-mb", "64", "--remote-url", server.url)
    x, y = list(range(1000, 1768)), list(range(3000, 3768))  # three whole chunks each
    store_and_flush(a, x, 3)
    store_and_flush(a, y, 6)
    kx, ky = chunk_keys(x), chunk_keys(y)
    r = server.client()
    # chunk 0 of x: one payload bit flipped
    v = bytearray(r.get(rv.value_key(kx[0], 0)))
    v[-1] ^= 1
    r.set(rv.value_key(kx[0], 0), bytes(v))
    # chunk 1 of y: its fixed prefix (magic, tag, MAC) kept, header and payload taken from y's chunk 2
    head1 = rv.read_head(r.get(rv.value_key(ky[1], 0)))
    v1, v2 = r.get(rv.value_key(ky[1], 0)), r.get(rv.value_key(ky[2], 0))
    fixed = len(v1) - len(head1.header) - len(head1.body)
    r.set(rv.value_key(ky[1], 0), v1[:fixed] + v2[fixed:])
    # chunk 0 of y: a genuine value of x copied under its key
    r.set(rv.value_key(ky[0], 0), r.get(rv.value_key(kx[1], 0)))
    b = daemon_factory("--ram-mb", "64", "--remote-url", server.url)
    with b.client(NS, strict=True) as cb:
        assert cb.get(x) is None  # chunk 0 fails its MAC: nothing of x is served
        assert cb.probe(y).n == 0  # chunk 0's tag is x's chunk's
        assert cb.get(y) is None
        rb = remote(cb)
        assert rb["hits"] == 0 and rb["auth_failures"] >= 2, rb


def test_a_daemon_with_another_key_neither_reads_nor_is_read(server, daemon_factory, tmp_path):
    a = daemon_factory("--ram-mb", "64", "--remote-url", server.url)
    c = daemon_factory("--ram-mb", "64", "--remote-url", server.url, "--remote-key-file", other_key_file(tmp_path))
    x, y = list(range(1000, 1512)), list(range(7000, 7512))
    store_and_flush(a, x, 2)
    store_and_flush(c, y, 2)
    b = daemon_factory("--ram-mb", "64", "--remote-url", server.url)  # A's key (the session's)
    with b.client(NS, strict=True) as cb, c.client(NS, strict=True) as cc:
        hit = cb.get(x)
        assert hit is not None and hit.n == 512
        assert_prefix_hit(hit, x)  # same key: shared as before, bit for bit
        assert cb.probe(y).n == 0 and cb.get(y) is None
        assert remote(cc)["key"] != remote(cb)["key"]
        before = remote(cc)
        assert cc.get(x) is None  # A's values, signed with a key C does not hold
        after = remote(cc)
        assert after["hits"] == before["hits"] and after["auth_failures"] > before["auth_failures"]


def test_a_daemon_with_a_remote_url_and_no_key_refuses_to_start(server, daemon_factory, tmp_path):
    missing = tmp_path / "none.key"
    d = daemon_factory("--ram-mb", "64", "--remote-url", server.url, "--remote-key-file", str(missing), start=False)
    d.start(wait=False)
    assert d.proc.wait(30) == 78
    assert "kvd keys remote" in d.log() and str(missing) in d.log()
    loose = tmp_path / "loose.key"
    loose.write_text(os.urandom(32).hex())
    loose.chmod(0o644)
    d = daemon_factory("--ram-mb", "64", "--remote-url", server.url, "--remote-key-file", str(loose), start=False)
    d.start(wait=False)
    assert d.proc.wait(30) == 78 and "chmod 600" in d.log()


def test_kvd_keys_remote_makes_one_key_and_never_overwrites_it(tmp_path):
    path = tmp_path / "shared.key"
    out = kvd("keys", "remote", "--remote-key-file", str(path))
    assert out.returncode == 0, out.stderr
    assert path.stat().st_mode & 0o777 == 0o600
    key = rv.RemoteKey.from_text(path.read_text())
    assert key.fingerprint in out.stdout and path.read_text().strip() not in out.stdout + out.stderr
    again = kvd("keys", "remote", "--remote-key-file", str(path))
    assert again.returncode != 0 and "exists" in again.stderr
    assert rv.RemoteKey.from_text(path.read_text()).fingerprint == key.fingerprint


# -- TLS and an ACL user -------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvd test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
             "-out", "server.csr", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=folder)
    return {name: folder / f"{name}" for name in ("ca.pem", "server.pem", "server.key")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_tls_with_a_ca_file_and_an_acl_user(daemon_factory, tmp_path):
    import redis

    certs = make_certs(tmp_path)
    port = free_port()
    server = RedisServer(
        "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["server.pem"]),
        "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.pem"]),
        "--tls-auth-clients", "no",
        "--user", "default", "off",
        "--user", "kvd", "on", ">s3cret-pw", "~kvd:*", "+@all",
    )
    server.proc = subprocess.Popen(
        [server.binary, "--bind", "127.0.0.1", "--dir", str(server.dir), "--save", "", "--appendonly", "no", *server.extra],
        stdout=open(server.dir / "server.log", "ab"), stderr=subprocess.STDOUT,
    )
    try:
        admin = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(certs["ca.pem"]),
                            username="kvd", password="s3cret-pw", socket_timeout=5)
        wait_until(lambda: _answers(admin), what="the TLS server")
        url = f"rediss://kvd:s3cret-pw@127.0.0.1:{port}/0"
        ca = ("--remote-ca-file", str(certs["ca.pem"]))
        a = daemon_factory("--ram-mb", "64", "--remote-url", url, *ca)
        b = daemon_factory("--ram-mb", "64", "--remote-url", url, *ca)
        x = list(range(1000, 1600))
        store_and_flush(a, x, 3)
        with b.client(NS, strict=True) as cb:
            hit = cb.get(x)
            assert hit is not None and hit.n == 600
            assert_prefix_hit(hit, x)
            rb = remote(cb)
            assert rb["auth_failures"] == 0 and not rb["degraded"] and "s3cret" not in str(rb)
        assert all(k.startswith(b"kvd:") for k in admin.keys("*"))
        # without the CA file the server's certificate is not trusted: the tier is degraded, nothing served
        c = daemon_factory("--ram-mb", "64", "--remote-url", url)
        with c.client(NS, strict=True) as cc:
            assert cc.get(x) is None
            wait_until(lambda: remote(cc)["degraded"], what="degraded without the CA")
        assert "s3cret" not in a.log() + b.log() + c.log()
    finally:
        server.close()


def _answers(client) -> bool:
    import redis

    try:
        return client.ping()
    except (redis.RedisError, OSError):
        time.sleep(0.05)
        return False


def test_a_remote_reached_in_the_clear_is_warned_about(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--remote-url", "redis://192.0.2.1:6379/0", "--remote-timeout-s", "0.2")
    assert "no TLS and no AUTH" in d.log()
