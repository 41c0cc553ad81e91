"""Per-namespace quotas: a flooding namespace evicts its own entries, never the others'."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvd.config import ConfigError, resolve
from kvd.server.evictions import EvictionRecord
from kvd.store import RamStore
from kvd.store.quota import Quotas, Rule
from kvd.store.ssd import SsdStore
from kvd.store.tiered import open_store

from support import FakeClock, assert_prefix_hit, assert_same, kvd, make_entry, prefix_snapshot

ENTRY = make_entry(0).nbytes  # 8 KiB of tensors + meta


def test_rules_exact_beats_prefix_and_longest_prefix_wins():
    q = Quotas.from_table({"mlx.*": {"ram_mb": 4}, "mlx.llama.*": {"ram_mb": 2, "ssd_gb": 1.5}, "mlx.llama.x": {"ssd_gb": 0}})
    assert q.rule_for("mlx.llama.x").pattern == "mlx.llama.x"
    assert q.rule_for("mlx.llama.y").pattern == "mlx.llama.*"
    assert q.rule_for("mlx.qwen").pattern == "mlx.*"
    assert q.rule_for("other") is None
    assert q.rule_for("mlx.llama.y").ssd_bytes == int(1.5 * (1 << 30))
    assert q.to_table() == {"mlx.*": {"ram_mb": 4}, "mlx.llama.*": {"ram_mb": 2, "ssd_gb": 1.5}, "mlx.llama.x": {"ssd_gb": 0.0}}


@pytest.mark.parametrize("table, needle", [
    ({"a": {"ram_gb": 1}}, "unknown key(s) ram_gb"),
    ({"a": {"ram_mb": -1}}, "ram_mb must be an integer >= 0"),
    ({"a": {"ssd_gb": "big"}}, "ssd_gb must be a number"),
    ({"a*b": {"ram_mb": 1}}, "'*' may only end a prefix"),
    ({"*": {"ram_mb": 1}}, "name a namespace or a prefix"),
    ({"a": 5}, "expected a table"),
])
def test_bad_quota_tables_are_config_errors(tmp_path, table, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        Quotas.from_table(table)
    cfg = tmp_path / "kvd.toml"
    cfg.write_text("[quota.a]\nram_gb = 1\n")
    with pytest.raises(ConfigError, match="quota"):
        resolve({}, environ={}, config_path=cfg)


def test_config_reads_the_quota_table(tmp_path):
    cfg = tmp_path / "kvd.toml"
    cfg.write_text('ram_mb = 64\n[quota."tenant-a/*"]\nram_mb = 16\nssd_gb = 2\n')
    c = resolve({}, environ={}, config_path=cfg)
    assert c.quota.rules == (Rule("tenant-a/*", 16 << 20, 2 << 30),)
    assert not resolve({}, environ={}).quota  # no file: no quotas


def test_ram_quota_evicts_the_flooders_own_oldest_first():
    ram = RamStore(20 * ENTRY)
    ram.quotas = Quotas([Rule("flood*", ram_bytes=3 * ENTRY)])
    rec = EvictionRecord()
    rec.attach(ram)
    quiet = [make_entry(i, ns="quiet") for i in range(5)]
    for e in quiet:
        ram.put(e)
    flood = [make_entry(i, ns=f"flood-{i % 2}") for i in range(100)]
    for e in flood:
        ram.put(e)
    for e in quiet:
        assert_same(ram.get(e.id), e)  # untouched
    held = [e for e in flood if ram.contains(e.id)]
    assert held == flood[-3:]  # the group's newest three, across both flood namespaces
    assert ram.ns_bytes["flood-0"] + ram.ns_bytes["flood-1"] == 3 * ENTRY
    assert rec.get(flood[0].id).why == "quota" and ram.quotas.evictions == {("flood*", "ram"): 97}
    # An entry larger than the whole quota is refused, not allowed to flush the group.
    big = make_entry(200, ns="flood-9", tokens=64)
    assert big.nbytes > 3 * ENTRY and ram.put(big).value == "too_big"


def test_ssd_quota_evicts_the_flooders_rows_and_spares_the_others(tmp_path):
    store = open_store(2 * ENTRY, tmp_path, ssd_bytes=1 << 20, min_free_bytes=0, write_through=True)
    quotas = Quotas([Rule("flood", ram_bytes=ENTRY, ssd_bytes=4 * 12288)])  # ~4 blobs on disk
    quotas.attach(store)
    rec = EvictionRecord()
    rec.attach(store)
    try:
        quiet = [make_entry(i, ns="quiet") for i in range(6)]
        for e in quiet:
            store.put(e)
        flood = [make_entry(i, ns="flood") for i in range(60)]
        for e in flood:
            store.put(e)
        store.flush()
        st = store.stats()
        assert st["namespaces"]["quiet"]["ssd_entries"] == 6
        assert 0 < st["namespaces"]["flood"]["ssd_bytes"] <= 4 * 12288
        assert st["tiers"]["ssd"]["evictions"] == quotas.evictions["flood", "ssd"] > 0
        assert rec.get(flood[0].id).why == "quota" and rec.get(flood[0].id).tier == "ssd"
        store.evict(0, tier="ram")  # RAM empty: what follows comes from disk
        for e in quiet:
            assert_same(store.get(e.id), e)
    finally:
        store.close()


BLOB = 12288  # what one make_entry blob takes on disk


def _ssd_with_quota(tmp_path, quota_blobs: int, ssd_blobs: int = 4096):
    store = open_store(2 * ENTRY, tmp_path, ssd_bytes=ssd_blobs * BLOB, min_free_bytes=0)
    quotas = Quotas([Rule("flood", ssd_bytes=quota_blobs * BLOB)])
    quotas.attach(store)
    return store, store.ssd, quotas


def test_a_lookup_that_finds_nothing_leases_nothing(tmp_path):
    """A lease protects a LOOKUP's yes until its GET. The PUT after a LOOKUP
    that said no is written behind; had the no been leased, that fresh row
    could not be evicted for `lease_s`, and a tier filling faster than that
    dropped every new chunk ("budget_leased", "quota") and kept the old."""
    store = open_store(2 * ENTRY, tmp_path, ssd_bytes=4 * BLOB, min_free_bytes=0, write_through=True)
    try:
        entries = [make_entry(i, ns="busy") for i in range(10)]
        for e in entries:
            assert store.held([e.id]) == [False]  # the client's LOOKUP before its PUT
            store.put(e)
            store.flush()
        ssd = store.stats()["tiers"]["ssd"]
        assert "budget_leased" not in ssd["drop_reasons"], ssd["drop_reasons"]
        assert [store.ssd.has_row(e.id) for e in entries] == [False] * 6 + [True] * 4  # the newest kept
        # A yes is still leased: the held entry survives the room made for others.
        assert store.held([entries[6].id]) == [True]
        for i in range(10, 14):
            store.put(make_entry(i, ns="busy"))
            store.flush()
        assert store.ssd.has_row(entries[6].id) and not store.ssd.has_row(entries[7].id)
    finally:
        store.close()


def test_a_group_that_cannot_make_room_costs_no_commit_per_chunk(tmp_path):
    """Every row of the flooding group leased (their LOOKUPs said yes): its
    new chunks are dropped, and that must not cost a synced commit each (the
    writer fell to ~200 chunks/s for every namespace, and a clean stop left
    other namespaces' acknowledged chunks unwritten)."""
    store, ssd, quotas = _ssd_with_quota(tmp_path, quota_blobs=4)
    try:
        held = [make_entry(i, ns="flood") for i in range(4)]
        ssd.write_batch(held)
        assert ssd.lease_many([e.id for e in held]) == [True] * 4
        batch = [make_entry(100 + i, ns=("flood" if i % 2 else "other")) for i in range(32)]
        txn0 = ssd.index.env.info()["last_txnid"]
        ssd.write_batch(batch)
        commits = ssd.index.env.info()["last_txnid"] - txn0
        assert commits <= 2, f"{commits} write transactions for one batch"
        assert all(ssd.has_row(e.id) for e in batch if e.namespace == "other")
        assert not any(ssd.has_row(e.id) for e in batch if e.namespace == "flood")
        assert all(ssd.has_row(e.id) for e in held)
        assert ssd.drop_reasons == {"quota": 16}
    finally:
        store.close()


def test_a_group_at_its_quota_in_a_full_tier_evicts_only_its_own(tmp_path):
    """The tier at its budget and the flooding group at its quota: a batch of
    the group's makes room from its own rows alone, since that room is the
    tier's too; the other namespace's older rows stay."""
    store, ssd, quotas = _ssd_with_quota(tmp_path, quota_blobs=4, ssd_blobs=8)
    try:
        others = [make_entry(i, ns="other") for i in range(4)]
        ssd.write_batch(others)  # the oldest rows
        ssd.write_batch([make_entry(10 + i, ns="flood") for i in range(4)])
        assert ssd.bytes == 8 * BLOB == ssd.budget_bytes
        ssd.write_batch([make_entry(20 + i, ns="flood") for i in range(3)])
        assert all(ssd.has_row(e.id) for e in others)
        assert 3 <= ssd.counters["evictions"] <= 4 and ssd.bytes <= 8 * BLOB  # (a quota evicts a tenth to spare)
    finally:
        store.close()


def test_with_quotas_disk_hits_ride_in_the_batch_commit_and_a_read_row_is_not_the_groups_victim(tmp_path):
    """A group's eviction chooses its victims on recency with the hits not
    yet recorded in mind: a hit on none of them rides in the batch's own
    index commit (with quotas they had a synced commit of their own before
    every batch); a hit on one is recorded first, and that row stays --
    though the group's rows are all young beside the tier's oldest (a hit
    on those is otherwise not recorded: SsdStore._hit)."""
    clock = FakeClock()
    ssd = SsdStore(tmp_path / "d", 4096 * BLOB, min_free_bytes=0, background=False, clock=clock,
                   touch_flush_s=3600, reconcile=False)
    Quotas([Rule("flood", ssd_bytes=4 * BLOB)]).attach(ssd)
    flood = [make_entry(i, ns="flood") for i in range(8)]

    def commits():
        return ssd.index.env.info()["last_txnid"]

    try:
        ssd.write_batch([make_entry(100, ns="other")])  # the tier's oldest row, long before the group's
        clock.advance(1000)
        for e in flood[:4]:
            clock.advance(1)
            ssd.write_batch([e])
        assert all(ssd.has_row(e.id) for e in flood[:4])
        # A hit on the newest row (no victim): the group evicts its oldest
        # (one commit) and the batch's commit carries the hit.
        clock.advance(1)
        assert_same(ssd.get(flood[3].id), flood[3])
        before, evictions = commits(), ssd.counters["evictions"]
        clock.advance(1)
        ssd.write_batch([flood[4]])
        assert ssd.counters["evictions"] > evictions and not ssd.has_row(flood[0].id)
        assert commits() == before + 2, "the hit had a commit of its own"
        assert not ssd._touched and not ssd._riding
        # A hit on the group's oldest row: recorded before the victims are
        # chosen, so the next oldest goes and the row just read stays.
        oldest = next(e for e in flood[:4] if ssd.has_row(e.id))
        clock.advance(1)
        assert_same(ssd.get(oldest.id), oldest)
        clock.advance(1)
        ssd.write_batch(flood[5:7])
        assert ssd.has_row(oldest.id), "the row just read was the group's victim"
        assert ssd.has_row(flood[5].id) and ssd.has_row(flood[6].id)
    finally:
        ssd.close()


@pytest.mark.parametrize("others", [200, 2000])
def test_the_quota_walk_does_not_grow_with_other_namespaces(tmp_path, monkeypatch, others):
    """The group's oldest rows are found without walking every older row of
    every other namespace for each batch (a quota'd flooder on a tier of a
    million rows: seconds of the writer's time a batch)."""
    store, ssd, quotas = _ssd_with_quota(tmp_path, quota_blobs=8)
    walked = [0]
    oldest_rows = type(ssd.index).oldest_rows

    def counted(index, txn, start=None):
        for item in oldest_rows(index, txn, start):
            walked[0] += 1
            yield item

    try:
        for k in range(0, others, 500):
            ssd.write_batch([make_entry(10_000 + i, ns="other") for i in range(k, min(others, k + 500))])
        monkeypatch.setattr(type(ssd.index), "oldest_rows", counted)
        n = 0
        for _ in range(3):  # the first batches find the group's rows once
            ssd.write_batch([make_entry(n + i, ns="flood") for i in range(8)])
            n += 8
        walked[0] = 0
        for _ in range(5):
            ssd.write_batch([make_entry(n + i, ns="flood") for i in range(8)])
            n += 8
        st = store.stats()
        assert st["namespaces"]["other"]["ssd_entries"] == others
        assert 0 < st["namespaces"]["flood"]["ssd_bytes"] <= 8 * BLOB
        assert quotas.evictions["flood", "ssd"] >= 5 * 8 - 8
        assert walked[0] <= 5 * 2 * 16, f"{walked[0]} rows walked for 5 batches of 8 beside {others} other rows"
    finally:
        store.close()


def test_a_row_put_below_where_the_walk_resumes_is_still_evicted_first(tmp_path):
    """A row can enter the recency order below the place the group's walk
    resumes at (a clock stepped back, a repaired row's old atime): the walk
    then starts from the oldest again, and that row goes first."""
    store, ssd, quotas = _ssd_with_quota(tmp_path, quota_blobs=8)
    try:
        n = 0
        for _ in range(3):
            ssd.write_batch([make_entry(n + i, ns="flood") for i in range(8)])
            n += 8
        clock = ssd._clock
        ssd._clock = lambda: clock() - 3600.0  # an hour back, for one batch
        old = make_entry(999, ns="flood")
        ssd.write_batch([old])
        ssd._clock = clock
        assert ssd.has_row(old.id)
        ssd.write_batch([make_entry(n + i, ns="flood") for i in range(4)])
        assert not ssd.has_row(old.id)
    finally:
        store.close()


def test_with_two_groups_a_row_put_below_either_place_is_still_evicted_first(tmp_path):
    """The walks of two groups resume at two places; a row put below the
    higher one (but above the lower) must void it too."""
    store = open_store(2 * ENTRY, tmp_path, ssd_bytes=4096 * BLOB, min_free_bytes=0)
    quotas = Quotas([Rule("a-*", ssd_bytes=8 * BLOB), Rule("b-*", ssd_bytes=8 * BLOB)])
    quotas.attach(store)
    ssd, now, n = store.ssd, [1000.0], 0
    ssd._clock = lambda: now[0]
    try:
        for ns, t0 in (("a-x", 1000.0), ("b-x", 2000.0)):  # a's place ~t=1000, b's ~t=2000
            now[0] = t0
            for _ in range(3):
                ssd.write_batch([make_entry(n + i, ns=ns) for i in range(8)])
                n, now[0] = n + 8, now[0] + 1
        now[0] = 1500.0  # the clock stepped back: between the two places
        old = make_entry(999, ns="b-x")
        ssd.write_batch([old])
        now[0] = 2100.0
        ssd.write_batch([make_entry(n + i, ns="b-x") for i in range(4)])
        assert not ssd.has_row(old.id)
    finally:
        store.close()


def test_a_place_in_one_index_means_nothing_in_another(tmp_path):
    """A healed index is a new Index (rows' atimes from their blobs): the
    places walks remembered in the old one must not match it."""
    from kvd.store.ssd.index import Index

    one, two = Index(tmp_path / "one"), Index(tmp_path / "two")
    try:
        assert one.lru_moves != two.lru_moves
    finally:
        one.close()
        two.close()


def test_two_namespaces_one_flooding_through_a_daemon(daemon_factory, tmp_path):
    d = daemon_factory(start=False)
    d.config.write_text('[quota."flood-*"]\nram_mb = 1\n')
    d.args = ["--ram-mb", "4", "--data-dir", "none"]
    d.start()
    quiet = [np.arange(256) + 100_000 * i for i in range(4)]  # ~290 KiB
    with d.client("quiet", strict=True) as q:
        for s in quiet:
            assert q.put(s, prefix_snapshot(s))
        for i in range(60):  # ~4.3 MiB over two namespaces sharing one 1 MiB quota
            s = np.arange(256) + 7_000 * i
            with d.client(f"flood-{i % 2}", strict=True) as f:
                assert f.put(s, prefix_snapshot(s))
        for s in quiet:
            hit = q.get(s)
            assert hit is not None and hit.n == 256
            assert_prefix_hit(hit, s)
        st = q.stats()
    quota = st["quotas"]["flood-*"]
    assert quota["namespaces"] == 2 and 0 < quota["ram_bytes"] <= quota["ram_quota_bytes"] == 1 << 20
    assert quota["ram_evictions"] > 0 and st["tiers"]["ram"]["evictions"] == quota["ram_evictions"]
    assert st["evictions"]["counts"] == {"ram evicted quota": quota["ram_evictions"]}

    r = kvd("ls", "--json", "--endpoint", d.endpoint)
    rows = json.loads(r.stdout)
    assert "quota" not in rows["quiet"]
    assert rows["flood-0"]["quota"]["pattern"] == "flood-*"
    assert rows["flood-1"]["quota"]["ram_bytes"] == quota["ram_bytes"]
    table = kvd("ls", "--endpoint", d.endpoint).stdout
    assert "flood-*" in table and "/ 1.0 MiB" in table, table
    cfg = kvd("config", "--config", str(d.config)).stdout
    assert '[quota."flood-*"]\nram_mb = 1' in cfg


@pytest.mark.parametrize("limits", [{"ssd_gb": float("inf")}, {"ssd_gb": float("nan")}, {"ssd_gb": 10**400},
                                    {"ram_mb": 10**30}, {"ssd_gb": 1e300}])
def test_quota_limits_must_be_finite_and_bounded(limits):
    with pytest.raises(ValueError, match="quota 'x'"):
        Quotas.from_table({"x": limits})
