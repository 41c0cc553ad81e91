"""kill -9 during heavy spill, many times: what `contains` reports is served bit-exact.

A child process opens the tiered store on one data dir and spills as fast as
it can (tiny RAM tier, an SSD budget small enough that LRU eviction runs
too). The parent kills it with SIGKILL at a random moment, reopens the data
dir, and checks the invariants; then the next child continues on the same
dir, so later kills also land in the start-up reconcile of the previous
crash.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from kvd.store.ssd import SsdStore

from kvd.store.base import entry_id

from support import TESTS, assert_same, key_of, make_entry

PER_RUN = 3000
WIDTH = 256  # 2 bf16 tensors of 2x16x256: 32 KiB per entry

CHILD = r"""
import random, sys
from kvd.store.tiered import open_store
from support import make_entry
root, run, per_run, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
one = make_entry(0, width=width)
store = open_store(2 * one.nbytes, root, ssd_bytes=300 * 40960, min_free_bytes=0,
                   queue_bytes=32 * one.nbytes)
print("ready", flush=True)
rng = random.Random(run)
for i in range(run * per_run, (run + 1) * per_run):
    store.put(make_entry(i, width=width))
    if i % 7 == 0 and i > per_run:  # re-put an older entry: duplicate or re-spill
        store.put(make_entry(rng.randrange(i), width=width))
    if i % 50 == 0:
        store.get(make_entry(rng.randrange(i + 1), width=width).id)  # disk hits, promotions
store.close()
print("finished", flush=True)
"""


def _check(root, runs_done: int) -> int:
    store = SsdStore(root, 300 * 40960, min_free_bytes=0)
    try:
        assert store.reconciled.wait(30)
        served = 0
        for i in range(runs_done * PER_RUN):
            if store.contains(entry_id(key_of("ns", i))):
                want = make_entry(i, width=WIDTH)
                assert_same(store.get(want.id), want)  # get() verified the checksum
                served += 1
        c = store.counters
        assert c["checksum_failures"] == 0 and c["misses"] == 0
        # After reconcile: no temp files, no blob without a row, no row
        # without a blob, LRU and totals agree with the rows, every blob intact.
        report = store.check()
        assert report.ok, report.summary()
        with store.index.reading() as txn:
            assert store.index.totals(txn)[1] <= store.budget_bytes
        return served
    finally:
        store.close()


@pytest.mark.slow
def test_kill_9_during_heavy_spill_many_times(tmp_path):
    root = tmp_path / "data"
    rng = random.Random(12345)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), str(TESTS)])}
    kills = 0
    served = []
    runs = 12
    for run in range(runs):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root), str(run), str(PER_RUN), str(WIDTH)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
        )
        line = child.stdout.readline().strip()
        assert line == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.02, 0.6))
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            kills += 1
        child.wait(10)
        served.append(_check(root, run + 1))
    assert kills >= runs - 1, "the child finished before it could be killed: make it work harder"
    print("entries served after each kill:", served)
    assert max(served) > 50, served  # the checks looked at real data
