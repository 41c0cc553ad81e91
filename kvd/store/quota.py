"""Per-namespace RAM and SSD quotas: a busy model evicts its own cache first.

Theory of operation
-------------------
Quotas come from the `[quota]` table of kvd.toml:

    [quota."mlx.llama.*"]        # every namespace starting "mlx.llama.", together
    ram_mb = 512
    ssd_gb = 4
    [quota."my-model-v1"]        # exactly this namespace
    ram_mb = 128                 # (a missing limit means: no quota in that tier)

A pattern ending in `*` is a prefix and covers every namespace that starts
with it, as one group (a tenant's models share its quota); any other
pattern is one namespace. A namespace belongs to the exact rule naming it,
else to the longest matching prefix, else to no rule (no quota).

Enforcement, per tier, when an entry of a quota'd group arrives:

    RAM  after the entry is added, the group's oldest RAM entries (never the
         new one) are evicted -- spilled to SSD when there is one -- until
         the group is within its quota, *before* the global LRU runs. An
         entry larger than the whole quota is refused (TOO_BIG; a tiered
         store then offers it to the SSD tier).
    SSD  on the writer thread, before the global budget check, the group's
         oldest rows on disk (leased ones excepted, as in `_make_room`) are
         evicted until the new blob fits; a blob larger than the whole
         quota is dropped ("quota").

So a namespace flooding the cache pushes out its own entries and leaves
everyone else's alone, as long as the quotas add up to less than the tier.
Finding a group's oldest entries walks the tier's LRU order, skipping other
groups. In RAM (the daemon thread) the walk starts at the old end: cheap when
the flooder's entries are the old ones, O(entries) at worst. On SSD (the
writer thread, where a tier of a million rows would make that seconds a
batch) each group's walk resumes at the first of its rows the last one met,
and a group that could not make room is not walked again until the writer
commits (`make_room_ssd`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

MiB = 1 << 20
GiB = 1 << 30
_MAX_MB = 1 << 40  # as kvd.config's MAX_MB / MAX_GB (the store does not import the config)
_MAX_GB = 1 << 30


def _short(raw: Any) -> str:
    """repr of a limit, cut short: an integer of 400 digits is no error message."""
    text = repr(raw)
    return text if len(text) <= 40 else f"a number of {len(text)} characters"


@dataclass(frozen=True, slots=True)
class Rule:
    """One quota: a namespace or a `prefix*`, and its limits in bytes (None = none)."""

    pattern: str
    ram_bytes: int | None = None
    ssd_bytes: int | None = None

    @property
    def prefix(self) -> bool:
        return self.pattern.endswith("*")

    def matches(self, ns: str) -> bool:
        return ns.startswith(self.pattern[:-1]) if self.prefix else ns == self.pattern


class Quotas:
    """The quota rules, and their enforcement on the tiers (module docstring)."""

    def __init__(self, rules: Iterable[Rule] = ()):
        self.rules: tuple[Rule, ...] = tuple(rules)
        self._exact = {r.pattern: r for r in self.rules if not r.prefix}
        self._prefixes = sorted((r for r in self.rules if r.prefix), key=lambda r: -len(r.pattern))
        self._cache: dict[str, Rule | None] = {}
        self.evictions: dict[tuple[str, str], int] = {}  # (pattern, tier) -> entries evicted for the quota
        # SSD writer's: where each group's next walk of the LRU begins (and the
        # index's lru_moves then), and the needs that failed since its last commit.
        self._ssd_from: dict[str, tuple[bytes | None, int]] = {}
        self._ssd_failed: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.rules)

    @classmethod
    def from_table(cls, table: Any) -> "Quotas":
        """Rules from the parsed `[quota]` TOML table. Raises ValueError naming the bad key."""
        if not isinstance(table, dict):
            raise ValueError("[quota] must be a table of tables, e.g. [quota.\"mlx.llama.*\"] ram_mb = 512")
        rules = []
        for pattern, limits in table.items():
            if not pattern or pattern == "*":
                raise ValueError(f"quota pattern {pattern!r}: name a namespace or a prefix ending in '*'")
            if "*" in pattern[:-1]:
                raise ValueError(f"quota pattern {pattern!r}: '*' may only end a prefix")
            if not isinstance(limits, dict):
                raise ValueError(f"quota {pattern!r}: expected a table with ram_mb and/or ssd_gb")
            unknown = sorted(set(limits) - {"ram_mb", "ssd_gb"})
            if unknown:
                raise ValueError(f"quota {pattern!r}: unknown key(s) {', '.join(unknown)}; known: ram_mb, ssd_gb")
            ram = limits.get("ram_mb")
            ssd = limits.get("ssd_gb")
            # Bounded (2**60 bytes each) so a byte count always fits the wire's
            # integers, and finite: inf or an integer of 400 digits is a typo.
            if ram is not None and (isinstance(ram, bool) or not isinstance(ram, int) or not 0 <= ram <= _MAX_MB):
                raise ValueError(f"quota {pattern!r}: ram_mb must be an integer >= 0 and <= {_MAX_MB}, got {_short(ram)}")
            if ssd is not None and (
                isinstance(ssd, bool) or not isinstance(ssd, (int, float))
                or not (isinstance(ssd, int) or math.isfinite(ssd)) or not 0 <= ssd <= _MAX_GB
            ):
                raise ValueError(f"quota {pattern!r}: ssd_gb must be a number >= 0 and <= {_MAX_GB}, got {_short(ssd)}")
            rules.append(Rule(pattern, None if ram is None else ram * MiB, None if ssd is None else int(ssd * GiB)))
        return cls(rules)

    def to_table(self) -> dict[str, dict[str, float]]:
        """The `[quota]` table these rules were read from (for `kvd config`)."""
        out: dict[str, dict[str, float]] = {}
        for r in self.rules:
            row = out[r.pattern] = {}
            if r.ram_bytes is not None:
                row["ram_mb"] = r.ram_bytes // MiB
            if r.ssd_bytes is not None:
                row["ssd_gb"] = r.ssd_bytes / GiB
        return out

    def rule_for(self, ns: str) -> Rule | None:
        try:
            return self._cache[ns]
        except KeyError:
            pass
        rule = self._exact.get(ns) or next((r for r in self._prefixes if r.matches(ns)), None)
        if len(self._cache) > 65536:
            self._cache.clear()  # bounded: namespaces are few, but a hostile client can invent many
        self._cache[ns] = rule
        return rule

    def _count(self, rule: Rule, tier: str, n: int) -> None:
        key = (rule.pattern, tier)
        self.evictions[key] = self.evictions.get(key, 0) + n

    def group_bytes(self, rule: Rule, per_ns: Mapping[str, int]) -> int:
        return sum(b for ns, b in per_ns.items() if self.rule_for(ns) is rule)

    # -- RAM (daemon thread) -----------------------------------------------------
    def admit_ram(self, entry: Any) -> bool:
        """False if `entry` alone is larger than its group's RAM quota."""
        rule = self.rule_for(entry.namespace)
        return rule is None or rule.ram_bytes is None or entry.nbytes <= rule.ram_bytes

    def enforce_ram(self, ram: Any, newest: Any) -> None:
        """Evict the oldest RAM entries of `newest`'s group (not `newest`)
        until the group is within its RAM quota."""
        rule = self.rule_for(newest.namespace)
        if rule is None or rule.ram_bytes is None:
            return
        over = self.group_bytes(rule, ram.ns_bytes) - rule.ram_bytes
        if over <= 0:
            return
        victims = []
        keep = newest.id
        for entry in ram.entries():  # oldest first
            if over <= 0:
                break
            if entry.id != keep and self.rule_for(entry.namespace) is rule:
                victims.append(entry.id)
                over -= entry.nbytes
        for eid in victims:
            ram.evict_entry(eid, "quota")
        self._count(rule, "ram", len(victims))

    # -- SSD (writer thread) -----------------------------------------------------
    def reset_failures(self) -> None:
        """The SSD writer starts a batch, or committed part of one: rows that
        stood in the way may be evictable now (see `make_room_ssd`)."""
        self._ssd_failed.clear()

    def make_room_ssd(self, ssd: Any, entry: Any, need: int, written: list) -> bool:
        """Evict the oldest committed rows of `entry`'s group until `need` more
        bytes fit its SSD quota, counting the batch's `written` (eid, row)s not
        yet committed. False if that cannot be done (the entry alone is over the
        quota, or only uncommitted or leased rows stand in the way).

        What it costs does not grow with the tier: the walk for a group
        resumes at the group's first row it left the last time (every row of
        the group lies past it, as long as the index's `lru_moves` says no key
        went below it), not at the oldest of every namespace's rows; and once
        a group could not make room, a need as large fails at once until the
        writer commits (`reset_failures`): a flood whose rows are all leased
        cost the writer a walk (or two) per chunk, and it fell to ~200
        chunks/s for every namespace."""
        rule = self.rule_for(entry.namespace)
        if rule is None or rule.ssd_bytes is None:
            return True
        if need > rule.ssd_bytes or need >= self._ssd_failed.get(rule.pattern, rule.ssd_bytes + 1):
            return False
        over, victims, freed = self._walk(ssd, rule, need, written)
        if over > 0 and ssd.record_hits_on(victims):
            # One was read since its row last moved: chosen again, hits recorded.
            over, victims, freed = self._walk(ssd, rule, need, written)
        if over <= 0:
            return True
        if freed < over:
            self._ssd_failed[rule.pattern] = need
            return False
        n, _ = ssd.evict_rows(victims, "quota")
        self._count(rule, "ssd", n)
        return n == len(victims)

    def _walk(self, ssd: Any, rule: Rule, need: int, written: list) -> tuple[int, list[bytes], int]:
        """How far `need` more bytes take the group over its quota, and the
        oldest committed rows of the group (not leased, not in `written`) to
        evict for it: (over, victims, their bytes)."""
        index = ssd.index
        pending = {eid for eid, _ in written}
        victims, freed, first = [], 0, None
        with index.reading() as txn:
            used = sum(v["bytes"] for ns, v in index.namespaces(txn).items() if self.rule_for(ns) is rule)
            used += sum(row.disk_bytes for _, row in written if self.rule_for(row.ns) is rule)
            over = used + need - rule.ssd_bytes
            if over <= 0:
                return over, victims, freed
            # A tenth of the quota more than needed: the group's next writes
            # then fit without an eviction each (a synced commit and a walk
            # of the LRU per chunk had slowed the writer to ~150 chunks/s,
            # and a stop then left acknowledged chunks of every namespace).
            want = over + rule.ssd_bytes // 10
            start, moves = self._ssd_from.get(rule.pattern, (None, -1))
            if moves != index.lru_moves:
                start = None
            for key, eid, row in index.oldest_rows(txn, start):
                if freed >= want:
                    break
                if self.rule_for(row.ns) is not rule:
                    continue
                first = first or key
                if eid in pending or ssd.leased(eid):
                    continue
                victims.append(eid)
                freed += row.disk_bytes
        # The group's first row met (evicted or not) is where its next walk begins.
        self._ssd_from[rule.pattern] = (first or start, index.lru_moves)
        marks = [k for k, _ in self._ssd_from.values() if k is not None]
        index.lru_guard = max(marks) if marks else None  # a key below any group's place voids them all
        return over, victims, freed

    def pending_in_group(self, entry: Any, written: list) -> bool:
        """Whether `written` (a batch's uncommitted (eid, row)s) holds rows of `entry`'s group."""
        rule = self.rule_for(entry.namespace)
        return any(self.rule_for(row.ns) is rule for _, row in written)

    def make_room_ssd_for(self, ssd: Any, items: list[tuple[Any, int]]) -> None:
        """Before a batch: for each group, room for all of its (entry, bytes)
        at once (one eviction, not one per chunk; `make_room_ssd` still
        checks each entry as it is written)."""
        need: dict[int, tuple[Any, int]] = {}
        for entry, nbytes in items:
            rule = self.rule_for(entry.namespace)
            if rule is not None and rule.ssd_bytes is not None:
                first, total = need.get(id(rule), (entry, 0))
                need[id(rule)] = (first, total + nbytes)
        for entry, total in need.values():
            rule = self.rule_for(entry.namespace)
            self.make_room_ssd(ssd, entry, min(total, rule.ssd_bytes), [])

    # -- reporting ---------------------------------------------------------------
    def report(self, stats: Mapping[str, Any]) -> dict[str, Any]:
        """Use against quota per rule, from a STATS map's namespaces; and each
        namespace's rule pattern is written into its namespace entry."""
        namespaces = stats.get("namespaces", {})
        tiered = "ssd" in stats.get("tiers", {})
        rows = {r.pattern: {"ram_quota_bytes": r.ram_bytes, "ssd_quota_bytes": r.ssd_bytes, "ram_bytes": 0,
                            "ssd_bytes": 0, "namespaces": 0, "ram_evictions": self.evictions.get((r.pattern, "ram"), 0),
                            "ssd_evictions": self.evictions.get((r.pattern, "ssd"), 0)}
                for r in self.rules}
        for ns, v in namespaces.items():
            rule = self.rule_for(ns)
            if rule is None:
                continue
            v["quota"] = rule.pattern
            row = rows[rule.pattern]
            row["namespaces"] += 1
            row["ram_bytes"] += v.get("ram_bytes", 0) if tiered else v.get("bytes", 0)
            row["ssd_bytes"] += v.get("ssd_bytes", 0)
        return rows

    def attach(self, store: Any) -> None:
        """Enforce these quotas on `store`'s tiers (RamStore, SsdStore or both)."""
        for tier in (getattr(store, "ram", None), getattr(store, "ssd", None), store):
            if tier is not None and hasattr(tier, "quotas"):
                tier.quotas = self
