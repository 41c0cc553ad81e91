"""The shared remote tier on a real Redis Cluster (issue 43).

One cluster for the module (tests/redis_server.py: three primaries, three
replicas, loopback ports), real `kvd serve` daemons with `--remote-cluster`.
The tests run in file order and each leaves the cluster as the next expects:
values spread over every primary and read back bit for bit by a fresh
daemon; a slot migration under a mixed load; a primary killed mid-read and
its replica promoted; the whole cluster stopped. Clients are strict=False:
what a failing node may cost is a miss, never an exception or a wrong byte
(every hit is checked bit for bit).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import tempfile
import threading
import time

import pytest

from redis_server import CLUSTER_SKIP, RedisCluster, cluster_supported, remote
from support import assert_prefix_hit, free_port, kvd, prefix_snapshot, scrape

pytestmark = pytest.mark.skipif(not cluster_supported(), reason=CLUSTER_SKIP)

NS = "cluster-test"
SEQS = [list(range(10_000 * i, 10_000 * i + 600)) for i in range(1, 9)]  # 8 x (2 chunks + a tail)


@pytest.fixture(scope="module")
def cluster():
    c = RedisCluster().start()
    yield c
    c.close()


def wait_for(what, cond, timeout: float = 20.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if cond(value) or time.monotonic() > deadline:
            assert cond(value), value
            return value
        time.sleep(every)


def daemon(daemon_factory, cluster, *extra: str, env: dict | None = None):
    return daemon_factory("--ram-mb", "64", "--data-dir", "none", "--remote-url", cluster.url, "--remote-cluster", *extra,
                          env=env)


def store(client, seqs) -> None:
    for toks in seqs:
        assert client.put(toks, prefix_snapshot(toks))
    wait_for(lambda: remote(client), lambda r: r["backlog"] == 0 and r["written"] >= 3 * len(seqs))


def with_seqs(cluster, daemon_factory) -> None:
    """SEQS in the cluster: stored by the first test of this module's worker
    that needs them (pytest-xdist may hand any of them to a worker first;
    each worker has a cluster of its own)."""
    if getattr(cluster, "seqs", False):
        return
    a = daemon(daemon_factory, cluster)
    with a.client(NS) as ca:
        store(ca, SEQS)
    cluster.seqs = True


def replicated(cluster) -> None:
    """Until every primary's replica has all it was sent (its offset is the primary's)."""
    def caught_up() -> bool:
        for p in cluster.roles()[0]:
            info = p.client().info("replication")
            offsets = [v["offset"] for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if not offsets or min(offsets) < info["master_repl_offset"]:
                return False
        return True
    wait_for(caught_up, bool)


def check(client, seqs, *, all_hit: bool) -> int:
    """Read every sequence: each hit bit-exact; returns the hits (all of them if `all_hit`)."""
    hits = 0
    for toks in seqs:
        hit = client.get(toks)
        if hit is not None:
            assert_prefix_hit(hit, toks)
            hits += hit.n == len(toks)
        elif all_hit:
            raise AssertionError(f"a miss for sequence {toks[0]}")
    return hits


def test_values_spread_over_every_primary_and_a_fresh_daemon_serves_them_bit_exact(cluster, daemon_factory):
    a = daemon(daemon_factory, cluster)
    with a.client(NS) as ca:
        store(ca, SEQS)
        cluster.seqs = True
        r = remote(ca)
        assert r["cluster_primaries"] == 3 and r["cluster_nodes"] >= 3
    primaries = cluster.roles()[0]
    sizes = [p.client().dbsize() for p in primaries]
    assert len(sizes) == 3 and min(sizes) > 0, sizes  # 24 values and their keys over 3 primaries
    # One value's keys share a slot: every key's hash tag is its main value's.
    for p in primaries:
        for key in p.client().keys("kvd:2:*"):
            assert re.fullmatch(rb"kvd:2:\{[0-9a-f]{64}\}(:b|:tails)?(:p\d+)?", key), key
    b = daemon(daemon_factory, cluster)
    with b.client(NS) as cb:
        assert check(cb, SEQS, all_hit=True) == len(SEQS)
        rb = remote(cb)
        assert rb["hits"] >= 3 * len(SEQS) and rb["checksum_failures"] == 0 and rb["auth_failures"] == 0
        assert rb["cluster_state"] in ("ok", "unknown") and rb["node_errors"] == {}


def test_a_slot_migration_under_a_mixed_load_costs_misses_at_most(cluster, daemon_factory):
    with_seqs(cluster, daemon_factory)
    a = daemon(daemon_factory, cluster)
    b = daemon(daemon_factory, cluster)
    primaries = cluster.roles()[0]
    src, dst = primaries[0], primaries[1]
    cmd = [cluster.cli, "--cluster", "reshard", f"127.0.0.1:{src.port}", "--cluster-from", cluster.node_id(src),
           "--cluster-to", cluster.node_id(dst), "--cluster-slots", "1000", "--cluster-yes"]
    new = [list(range(500_000 + 10_000 * i, 500_000 + 10_000 * i + 600)) for i in range(30)]
    with a.client(NS) as ca, b.client(NS) as cb:
        log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill and stall redis-cli
        reshard = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        rng = random.Random(43)
        i = 0
        deadline = time.monotonic() + 120
        while (reshard.poll() is None or i < 5) and time.monotonic() < deadline:
            if i < len(new):
                assert ca.put(new[i], prefix_snapshot(new[i]))
            pick = SEQS + new[: max(1, i - 2)]
            check(cb, [rng.choice(pick)], all_hit=False)
            i += 1
        assert reshard.wait(60) == 0, (log.seek(0), log.read()[-2000:])
        for toks in new[i:]:
            assert ca.put(toks, prefix_snapshot(toks))
        wait_for(lambda: remote(ca), lambda r: r["backlog"] == 0)
    cluster.wait_ok()
    # After the migration a fresh daemon finds everything (the map refreshed by itself).
    c = daemon(daemon_factory, cluster)
    with c.client(NS) as cc:
        wait_for(lambda: check(cc, SEQS + new, all_hit=False), lambda n: n == len(SEQS + new), timeout=30, every=0.5)


def test_a_primary_killed_mid_read_costs_misses_and_its_replica_takes_over(cluster, daemon_factory):
    with_seqs(cluster, daemon_factory)
    replicated(cluster)  # so the replica promoted holds every value: nothing may be lost
    # B asks a dead primary's replica (remote_read_replicas, the default);
    # P keeps reads on primaries, so the dead one's keys are misses.
    port = free_port()
    b = daemon(daemon_factory, cluster, "--metrics-port", str(port))
    p = daemon(daemon_factory, cluster, env={"KVD_REMOTE_READ_REPLICAS": "false"})
    victim = cluster.roles()[0][2]
    errors: list[BaseException] = []
    reads: dict = {b: [], p: []}  # hits per pass
    stop = threading.Event()

    def reader(d):
        try:
            with d.client(NS) as c:
                while not stop.is_set():
                    c.gc(ns=NS, dry_run=False, orphans=False)  # its RAM emptied: every read goes to the cluster
                    reads[d].append(check(c, SEQS, all_hit=False))  # every hit bit-exact
        except BaseException as exc:  # noqa: BLE001 - what the test asserts is absent
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(d,)) for d in (b, p)]
    for t in threads:
        t.start()
    wait_for(lambda: min(map(len, reads.values())), lambda n: n >= 2)
    victim.stop()  # SIGKILL
    after = {d: len(r) for d, r in reads.items()}
    wait_for(lambda: min(len(reads[d]) - after[d] for d in reads), lambda n: n >= 5)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    dead = f"127.0.0.1:{victim.port}"
    with b.client(NS) as cb, p.client(NS) as cp:
        rb, rp = remote(cb), remote(cp)
        # The killed node's reads failed, counted under its name, and nothing else went wrong.
        for r in (rb, rp):
            assert r["node_errors"].get(dead, 0) > 0 and r["checksum_failures"] == 0 and r["auth_failures"] == 0, r
    # Primaries only: the dead node's keys were misses until the failover.
    assert min(reads[p][after[p]:]) < len(SEQS), reads[p]
    # What an operator sees: `kvd stats --json` and /metrics, per node.
    shown = json.loads(kvd("stats", "--json", "--endpoint", b.endpoint).stdout)["tiers"]["remote"]
    assert shown["node_errors"].get(dead, 0) > 0 and shown["cluster_nodes"] >= 3 and "cluster_state" in shown
    table = kvd("stats", "--endpoint", b.endpoint)
    assert table.returncode == 0 and "cluster_state=" in table.stdout and dead in table.stdout, table
    metrics = scrape(port)
    assert metrics[("kvd_tier_node_errors_total", (("node", dead), ("tier", "remote")))] > 0
    assert ("kvd_tier_cluster_ok", (("tier", "remote"),)) in metrics
    cluster.wait_ok(60)  # the replica promoted, every slot covered again
    assert len(cluster.roles()[0]) == 3
    c = daemon(daemon_factory, cluster)
    with c.client(NS) as cc:
        wait_for(lambda: check(cc, SEQS, all_hit=False), lambda n: n == len(SEQS), timeout=30, every=0.5)
        wait_for(lambda: remote(cc)["cluster_state"], lambda s: s == "ok", timeout=15, every=0.2)
    with b.client(NS) as cb:
        rb = remote(cb)
        assert rb["checksum_failures"] == 0 and rb["auth_failures"] == 0
        assert check(cb, SEQS, all_hit=True) == len(SEQS)


def test_the_whole_cluster_stopped_the_local_tiers_keep_serving(cluster, daemon_factory):
    a = daemon(daemon_factory, cluster)
    more = [list(range(900_000 + 10_000 * i, 900_000 + 10_000 * i + 600)) for i in range(4)]
    with a.client(NS) as ca:
        store(ca, more)
        for s in cluster.servers:
            s.stop()
        assert check(ca, more, all_hit=True) == len(more)  # from A's RAM
        toks = list(range(990_000, 990_600))
        assert ca.put(toks, prefix_snapshot(toks))  # nothing remote on a PUT's path
        assert check(ca, [toks], all_hit=True) == 1
        assert ca.get(list(range(5, 605))) is None  # nowhere: a miss, no error
        wait_for(lambda: remote(ca)["degraded"], bool, timeout=20)


def test_stats_never_wait_for_a_discovery_under_way():
    """Red-team (session 41): the cluster client's discovery held the lock
    STATS takes (on the serving thread), so a node trickling its CLUSTER
    SLOTS reply held every `kvd stats`. The discovery here is a stand-in that
    waits for the test: a node that slow cannot be had from a real server."""
    from kvd.store.remote.cluster import Nodes

    inside, leave = threading.Event(), threading.Event()

    def discovering():
        inside.set()
        leave.wait(30)
        raise ConnectionError("no node answered")

    nodes = Nodes(discovering, read_replicas=True)
    t = threading.Thread(target=lambda: pytest.raises(ConnectionError, lambda: nodes.client))
    t.start()
    try:
        assert inside.wait(5)
        done = threading.Event()
        threading.Thread(target=lambda: (nodes.stats(), done.set()), daemon=True).start()
        assert done.wait(5), "stats() waited for the discovery"
    finally:
        leave.set()
        t.join(5)
