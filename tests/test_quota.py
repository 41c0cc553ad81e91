"""Per-namespace quotas: a flooding namespace evicts its own entries, never the others'."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvd.config import ConfigError, resolve
from kvd.server.evictions import EvictionRecord
from kvd.store import RamStore
from kvd.store.quota import Quotas, Rule
from kvd.store.tiered import open_store

from support import assert_prefix_hit, assert_same, kvd, make_entry, prefix_snapshot

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
