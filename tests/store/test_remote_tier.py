"""The shared remote tier against a real redis-server and real daemons.

Two `kvd serve` processes with separate data dirs point at one throwaway
server (tests/redis_server.py). What one stores, the other fetches bit for
bit; a killed server degrades both to their local tiers and they resume by
themselves; a corrupted value is a miss plus a counter; a server with a
small `maxmemory` evicts without breaking anything; secrets never show.
Every wait is a bounded poll of the daemons' own counters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvd.protocol import keys
from kvd.protocol import remote_value as rv
from redis_server import SKIP_REASON, RedisServer, redis_binary, function_server, remote  # noqa: F401 (the fixture "server")
from support import assert_prefix_hit, free_port, kvd, prefix_snapshot, scrape

pytestmark = pytest.mark.skipif(redis_binary() is None, reason=SKIP_REASON)

NS = "remote-test"


def wait_for(what, cond, timeout: float = 15.0):
    """Poll `what()` until `cond(value)`; the last value (asserted)."""
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if cond(value) or time.monotonic() > deadline:
            assert cond(value), value
            return value
        time.sleep(0.02)


def written(client, n: int) -> dict:
    """The remote stats once the write-behind backlog is empty and >= n entries are written."""
    return wait_for(lambda: remote(client), lambda r: r["backlog"] == 0 and r["written"] >= n)


def pair(daemon_factory, url: str, *extra: str):
    a = daemon_factory("--ram-mb", "64", "--remote-url", url, *extra)
    b = daemon_factory("--ram-mb", "64", "--remote-url", url, *extra)
    return a, b


def test_a_cache_stored_through_one_daemon_is_fetched_bit_exact_through_another(server, daemon_factory):
    a, b = pair(daemon_factory, server.url)
    tokens = list(range(1000, 1600))  # two chunks and a 88-token tail
    with a.client(NS, strict=True) as ca, b.client(NS, strict=True) as cb:
        assert cb.get(tokens) is None  # nothing anywhere yet
        assert ca.put(tokens, prefix_snapshot(tokens, boundary=True))
        written(ca, 4)  # 3 chunks + the boundary entry
        probe = cb.probe(tokens)
        assert probe.n == 600 and probe.boundaries == (600,)
        hit = cb.get(tokens, need_boundary=True)
        assert hit is not None and hit.n == 600
        assert_prefix_hit(hit, tokens)  # every dtype of ALL_DTYPES, bit for bit
        want = prefix_snapshot(tokens, boundary=True)
        assert hit.boundary["state"].array.tobytes() == want.boundary["state"].array.tobytes()
        rb = remote(cb)
        assert rb["hits"] == 4 and rb["checksum_failures"] == 0 and rb["promotions"] == 4
        assert rb["bytes_in"] > 0 and rb["written"] == 0  # promoted entries are not written back
        # A longer query with another continuation finds the stored tail through the tail hash.
        longer = tokens + [7, 8, 9]
        assert cb.probe(longer).n == 600
        # Promoted into B's local tiers: served with the server gone.
        server.stop()
        hit = cb.get(tokens)
        assert hit is not None and hit.n == 600
        assert_prefix_hit(hit, tokens)


def test_a_quantized_mlx_cache_crosses_machines(server, daemon_factory):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import make_prompt_cache

    from kvd_client import Client
    from kvd_client.mlx_lm import namespace_for
    from models import build, continue_from, prefill, prompt

    a, b = pair(daemon_factory, server.url)
    model = build("llama")
    tokens = prompt(200)
    with mx.stream(mx.new_thread_local_stream(mx.cpu)):
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache)
        quant = [c.to_quantized(group_size=32, bits=4) for c in cache]
        ns = namespace_for(model, kv_bits=4, kv_group_size=32)
        with Client(a.endpoint, namespace=ns, chunk_tokens=64, strict=True) as ka:
            assert ka.store(tokens, quant)
            assert ka.flush_stores(30)
            written(ka, 4)
        with Client(b.endpoint, namespace=ns, chunk_tokens=64, strict=True) as kb:
            fetched, n = kb.fetch(tokens + [1])
            assert n == 200 and [type(c).__name__ for c in fetched] == ["QuantizedKVCache"] * len(quant)
            # The same continuation, bit for bit, from the fetched and the original triples.
            assert continue_from(model, fetched) == continue_from(model, quant)
            assert remote(kb)["hits"] >= 4


def test_the_remote_killed_mid_run_both_daemons_serve_locally_and_resume(server, daemon_factory):
    a, b = pair(daemon_factory, server.url, "--remote-timeout-s", "0.3")
    first, second = list(range(300)), list(range(5000, 5300))
    with a.client(NS, strict=True) as ca, b.client(NS, strict=True) as cb:
        assert ca.put(first, prefix_snapshot(first))
        written(ca, 2)
        assert cb.get(first).n == 300  # B holds it locally now
        server.stop()
        # A stores while the server is down: stored locally, degraded, counted.
        assert ca.put(second, prefix_snapshot(second))
        ra = wait_for(lambda: remote(ca), lambda r: r["degraded"])
        assert ra["errors"] >= 1 and ra["backlog"] == 2 and ra["degraded_episodes"] == 1
        for c, toks in ((ca, first), (ca, second), (cb, first)):  # local tiers keep serving
            hit = c.get(toks)
            assert hit is not None and hit.n == 300
            assert_prefix_hit(hit, toks)
        assert cb.get(second) is None  # B has no copy and the remote is down: a miss, no error
        server.start()
        # Both resume by themselves: A's backlog is written, then B fetches it.
        ra = written(ca, 4)
        assert not ra["degraded"] and ra["degraded_episodes"] == 1
        hit = wait_for(lambda: cb.get(second), lambda h: h is not None and h.n == 300)
        assert_prefix_hit(hit, second)
        assert not remote(cb)["degraded"]
    assert a.log().count("unavailable") == 1 and a.log().count("is back") == 1  # one line per episode


def test_a_corrupted_value_on_the_remote_is_a_miss_and_a_counter(server, daemon_factory):
    a, b = pair(daemon_factory, server.url)
    tokens = list(range(600))
    with a.client(NS, strict=True) as ca, b.client(NS, strict=True) as cb:
        assert ca.put(tokens, prefix_snapshot(tokens))
        written(ca, 3)
        second = keys.chain(NS, 256, keys.token_bytes(tokens))[1]
        r = server.client()
        main = rv.value_key(second, 0)
        value = bytearray(r.get(main))
        value[-5] ^= 0x40  # one bit of tensor data
        r.set(main, bytes(value))
        hit = cb.get(tokens)
        assert hit is not None and hit.n == 256  # the prefix before the bad chunk, never its bytes
        assert_prefix_hit(hit, tokens)
        rb = remote(cb)
        assert rb["auth_failures"] == 1 and rb["checksum_failures"] == 0 and rb["hits"] == 2  # chunk 0 and the tail; a flipped bit fails the MAC
        assert "refused" in b.log()


def test_a_small_maxmemory_with_allkeys_lru_evicts_without_breaking_anything(daemon_factory):
    server = RedisServer("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru").start()
    try:
        a, b = pair(daemon_factory, server.url, "--remote-part-mb", "1")
        seqs = [[s * 10_000 + i for i in range(600)] for s in range(24)]  # ~4 MiB in all
        with a.client(NS, strict=True) as ca, b.client(NS, strict=True) as cb:
            for toks in seqs:
                assert ca.put(toks, prefix_snapshot(toks))
            ra = written(ca, 3 * len(seqs))
            assert ra["errors"] == 0 and not ra["degraded"]
            assert int(server.client().info("stats")["evicted_keys"]) > 0
            served = 0
            for toks in seqs:
                hit = cb.get(toks)
                if hit is not None:
                    assert_prefix_hit(hit, toks)
                    served += 1
            assert 0 < served < len(seqs)  # the recent ones survive, the oldest were evicted
            rb = remote(cb)
            assert rb["errors"] == 0 and rb["checksum_failures"] == 0 and not rb["degraded"]
    finally:
        server.close()


def test_credentials_are_never_shown(daemon_factory, tmp_path):
    secret = "s3cret-Pa55"
    server = RedisServer(password=secret).start()
    try:
        url = server.url
        assert secret in url
        a = daemon_factory("--ram-mb", "64", env={"KVD_REMOTE_URL": url})
        tokens = list(range(300))
        with a.client(NS, strict=True) as ca:
            assert ca.put(tokens, prefix_snapshot(tokens))
            r = written(ca, 2)  # the password reached the server
            assert r["url"] == f"redis://default:***@127.0.0.1:{server.port}/0"
            assert secret not in json.dumps(ca.stats())
        out = kvd("stats", "--endpoint", a.endpoint)
        assert out.returncode == 0 and "default:***@" in out.stdout and secret not in out.stdout
        for args in (["config"], ["config", "--json"]):
            cfg = subprocess.run([sys.executable, "-m", "kvd", *args, "--config", str(a.config)],
                                 capture_output=True, text=True, env={**os.environ, "KVD_REMOTE_URL": url}, timeout=60)
            assert cfg.returncode == 0 and "default:***@" in cfg.stdout and secret not in cfg.stdout + cfg.stderr
        a.stop()
        assert "default:***@" in a.log() and secret not in a.log()
    finally:
        server.close()


def test_a_daemon_without_remote_url_never_imports_redis(daemon_factory):
    d = daemon_factory("--ram-mb", "64", start=False)
    # `python -X importtime` lists every module the daemon imports, on stderr (its log).
    d.command = lambda: [sys.executable, "-X", "importtime", "-m", "kvd", "serve", "--endpoint", d.endpoint,
                         "--config", str(d.config), "--data-dir", str(d.data_dir), "--ram-mb", "64"]
    d.start()
    with d.client(NS, strict=True) as c:
        assert c.put(list(range(10)), prefix_snapshot(list(range(10))))
        assert "remote" not in c.stats()["tiers"]
    d.stop()
    lines = [l for l in d.log().splitlines() if l.startswith("import time:")]
    assert len(lines) > 100 and any("kvd.store.tiered" in l for l in lines)
    assert not [l for l in lines if l.split("|")[-1].strip().split(".")[0] in ("redis", "hiredis")]


def test_metrics_show_the_remote_tier(server, daemon_factory):
    port = free_port()
    a = daemon_factory("--ram-mb", "64", "--remote-url", server.url)
    b = daemon_factory("--ram-mb", "64", "--remote-url", server.url, "--metrics-port", str(port))
    tokens = list(range(300))
    with a.client(NS, strict=True) as ca, b.client(NS, strict=True) as cb:
        assert ca.put(tokens, prefix_snapshot(tokens))
        written(ca, 2)
        assert cb.get(tokens).n == 300
        m = scrape(port)
        tier = (("tier", "remote"),)
        assert m[("kvd_tier_hits_total", tier)] == 2 and m[("kvd_tier_degraded", tier)] == 0
        assert m[("kvd_tier_bytes_in_total", tier)] > 0 and m[("kvd_tier_backlog", tier)] == 0
        assert m[("kvd_tier_errors_total", tier)] == 0 and m[("kvd_tier_written_total", tier)] == 0


def test_a_remote_that_hangs_costs_one_timeout_then_nothing_until_it_answers(server, daemon_factory):
    a, b = pair(daemon_factory, server.url, "--remote-timeout-s", "0.3")
    first, second = list(range(300)), list(range(7000, 7300))
    with a.client(NS, strict=True) as ca, b.client(NS, strict=True) as cb:
        assert ca.put(first, prefix_snapshot(first))
        written(ca, 2)
        server.proc.send_signal(signal.SIGSTOP)  # alive, accepting, never answering
        try:
            assert cb.get(first) is None  # one round trip times out: a miss, then degraded
            rb = remote(cb)
            assert rb["degraded"] and rb["errors"] >= 1 and "TimeoutError" in rb["degraded_reason"]
            queries = rb["exists_queries"]
            assert cb.get(first) is None and remote(cb)["exists_queries"] == queries  # not asked while degraded
            assert ca.put(second, prefix_snapshot(second))  # stored locally; the writer times out off the path
            assert ca.get(second).n == 300
            wait_for(lambda: remote(ca), lambda r: r["degraded"])
        finally:
            server.proc.send_signal(signal.SIGCONT)
        written(ca, 4)
        hit = wait_for(lambda: cb.get(second), lambda h: h is not None and h.n == 300)
        assert_prefix_hit(hit, second)


@pytest.mark.auto_host(reason="shm_open segments can be cut short: the daemon reads cold hits into its heap first")
def test_a_remote_hit_is_checked_in_private_memory_then_moved_in_with_its_digests(server, daemon_factory):
    """Values fetched from the remote are checked (their MAC) in the heap,
    where no other process can write; the shm GET that serves them moves them
    into arena slots with digests fixed from those bytes, and they are exact."""
    a, b = pair(daemon_factory, server.url)
    tokens = list(range(2000, 3100))  # four chunks and a 76-token tail, with boundary state
    with a.client(NS, strict=True) as ca:
        assert ca.put(tokens, prefix_snapshot(tokens, boundary=True))
        written(ca, 6)
    with b.client(NS, strict=True, transport="shm") as cb:
        hit = cb.get(tokens, need_boundary=True)
        assert hit is not None and hit.n == 1100
        assert_prefix_hit(hit, tokens)
        assert cb.counters["shm_gets"] >= 1
        s = cb.stats()
    assert s["tiers"]["remote"]["hits"] == 6 and s["tiers"]["remote"]["promotions"] == 6
    assert s["shm"]["adopted_bytes"] > 0 and s["shm"]["allocs"] >= 1 and cb.counters["shm_damaged"] == 0


def test_a_remote_read_with_no_thread_to_spare_is_served_not_internal(server, daemon_factory):
    """Regression (a red-team find): under a pids limit the remote tier could
    not start its read-ahead threads, and every GET that reached it was
    answered INTERNAL. Its reads run on the serving thread then."""
    from support import no_more_threads

    a, b = pair(daemon_factory, server.url)
    tokens = list(range(2000, 2600))
    with a.client(NS, strict=True) as ca, b.client(NS, strict=True) as cb:
        assert ca.put(tokens, prefix_snapshot(tokens))
        written(ca, 3)
        with no_more_threads(b.proc.pid):  # B's reader threads were never started
            hit = cb.get(tokens)
            assert hit is not None and hit.n == 600
            assert_prefix_hit(hit, tokens)
        assert cb.stats()["server"]["errors"].get("INTERNAL", 0) == 0


def _p99(samples: list[float]) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def test_a_paused_remote_holds_nobody_but_its_asker(server, daemon_factory):
    """Issue 44: with the server SIGSTOPped, a GET that needs it waits (its
    round trip runs on a reader thread, the request parked) while another
    client's PINGs keep their latency, and so do its GETs of what the local
    tiers hold (they do not wait for the server to extend them); the GET
    then answers: a miss after remote_timeout_s, or the value once the
    server resumes."""
    import threading

    timeout = 2.0
    a, b = pair(daemon_factory, server.url, "--remote-timeout-s", str(timeout))
    first, second = list(range(300)), list(range(7000, 7300))
    with a.client(NS, strict=True) as ca, b.client(NS, strict=True, timeout=10.0) as cb, \
            b.client("bystander", strict=True, timeout=10.0) as other:
        assert ca.put(first, prefix_snapshot(first)) and ca.put(second, prefix_snapshot(second))
        mine = list(range(50_000, 50_300))
        assert other.put(mine, prefix_snapshot(mine))  # the bystander's own, in B's RAM
        written(ca, 4)
        idle = [other.ping() for _ in range(300)]
        assert None not in idle

        def get_while_pinging(tokens, while_waiting=None):
            got: dict = {}
            asker = threading.Thread(target=lambda: got.update(hit=cb.get(tokens), at=time.monotonic()))
            before = other.stats()["server"]["requests"].get("GET", 0)
            start = time.monotonic()
            asker.start()
            pings, local_gets = [], []
            while asker.is_alive():
                pings.append(other.ping())
                t0 = time.monotonic()
                own = other.get(mine + [1, 2, 3])  # a local hit; the server might hold more of it
                local_gets.append(time.monotonic() - t0)
                assert own is not None and own.n == 300
                if while_waiting is not None and other.stats()["server"]["requests"].get("GET", 0) > before:
                    while_waiting()  # the GET is in (parked on the server): now act
                    while_waiting = None
            asker.join()
            assert None not in pings
            assert max(local_gets) < timeout / 4, max(local_gets)
            return got["hit"], got["at"] - start, pings

        server.proc.send_signal(signal.SIGSTOP)  # alive, accepting, never answering
        try:
            hit, waited, pings = get_while_pinging(first)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert hit is None and waited >= 0.8 * timeout  # the asker waited for the server, then missed
        assert remote(cb)["degraded"]
        # Before: the serving thread waited with the asker, so PINGs took up to remote_timeout_s.
        assert len(pings) >= 30, len(pings)
        bound = max(10 * _p99(idle), 0.05)
        assert _p99(pings) <= bound and max(pings) < timeout / 4, (_p99(idle), _p99(pings), max(pings))

        wait_for(lambda: remote(cb), lambda r: not r["degraded"])  # the tier probes and resumes by itself
        server.proc.send_signal(signal.SIGSTOP)
        try:
            hit, waited, pings = get_while_pinging(second, lambda: server.proc.send_signal(signal.SIGCONT))
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert hit is not None and hit.n == 300  # served once the server answered, within its timeout
        assert_prefix_hit(hit, second)
        assert _p99(pings) <= bound, (_p99(idle), _p99(pings))
        assert cb.stats()["server"]["errors"].get("INTERNAL", 0) == 0


def _asked(server) -> int:
    """The questions the server was asked (HMGET, GETRANGE, GET, EXISTS calls),
    by its own INFO commandstats: what a tier's reader threads sent it."""
    import redis

    with redis.Redis.from_url(server.url) as r:
        stats = r.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k.split("_", 1)[1] in ("hmget", "getrange", "get", "exists", "mget"))


def test_a_paused_remote_gathers_no_queue_of_questions_from_local_hits(server, daemon_factory):
    """A GET the local tiers hit asks the server, on a reader thread, whether
    it holds more (the answer serves later GETs). While the server is paused,
    300 such GETs of one prefix ask once, not 300 times: before, each asked
    again, the reader threads worked through the queue once the server
    resumed, and a request parked on the server waited behind it (bench
    paused-remote: 70-150 ms after the resume, ~90 ms of them everyone's)."""
    d = daemon_factory("--ram-mb", "64", "--remote-url", server.url, "--remote-timeout-s", "5")
    mine = list(range(50_000, 50_300))
    with d.client(NS, strict=True, timeout=10.0) as c:
        assert c.put(mine, prefix_snapshot(mine))
        written(c, 2)
        before = _asked(server)
        server.proc.send_signal(signal.SIGSTOP)  # alive, accepting, never answering
        try:
            for _ in range(300):
                hit = c.get(mine + [1, 2, 3])  # a local hit; the server might hold more of it
                assert hit is not None and hit.n == 300
        finally:
            server.proc.send_signal(signal.SIGCONT)
        # A GET that needs the server: its question goes to the reader
        # threads after whatever was queued while the server was paused.
        assert c.get(list(range(90_000, 90_600))) is None
        asked = _asked(server) - before
        assert asked <= 12, asked  # the hint's question(s) and the cold GET's own, not ~300
        assert not remote(c)["degraded"]


def test_cold_gets_of_different_chains_at_once_are_all_served(server, daemon_factory):
    """Four clients' cold GETs, parked on the remote tier at once, are all
    served bit-exact: each new stream leaves the batches other parked GETs
    wait for to finish (on loopback the reads are quick enough that this
    test passes without that rule too: it guards the concurrency, not the
    rule alone)."""
    import threading

    a, b = pair(daemon_factory, server.url)
    chains = [list(range(k * 10_000, k * 10_000 + 1100)) for k in range(4)]  # 4 chunks and a tail each
    with a.client(NS, strict=True) as ca:
        for tokens in chains:
            assert ca.put(tokens, prefix_snapshot(tokens))
        written(ca, 4 * 5)
    hits: dict[int, object] = {}

    def fetch(k: int) -> None:
        with b.client(NS, strict=True, timeout=20.0) as cb:
            hits[k] = cb.get(chains[k])

    threads = [threading.Thread(target=fetch, args=(k,)) for k in range(len(chains))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k, tokens in enumerate(chains):
        assert hits[k] is not None and hits[k].n == 1100, (k, hits.get(k))
        assert_prefix_hit(hits[k], tokens)
    with b.client(NS) as cb:
        s = cb.stats()
    assert s["tiers"]["remote"]["hits"] >= 20 and s["server"]["errors"].get("INTERNAL", 0) == 0
