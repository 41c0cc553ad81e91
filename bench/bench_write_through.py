"""What a write-through acknowledgement costs, and what group commit buys.

One command:

    .venv/bin/python bench/bench_write_through.py [--puts 400] [--clients 1,8]

Against a real `kvd serve`, each client PUTs one-chunk sequences (256 tokens,
~70 KiB) one after another, waiting for each answer. Run once in write-back
mode (the baseline: answered from RAM) and once with `--write-through`
(answered after fsync + commit), with 1 and with N clients at once: the PUTs
of concurrent clients share the writer's batches (one parallel fsync round and
one LMDB commit each), so write-through throughput grows with the clients.
Prints PUTs/s and p50/p99 latency, and the write-through/baseline ratio.

    .venv/bin/python bench/bench_write_through.py --sizes 256,1024 [--reps 3] [--baseline-src DIR]

Big stores, durable soon after (issue 42): one client PUTs a cache of SIZE
MiB (bf16 keys and values of 32 layers x 8 heads x 128: 256 MiB is 2,048
tokens, eight 256-token chunks of 32 MiB) into a write-through daemon, which answers once every chunk is fsynced and
indexed; against the baseline measured in the same run on the same
filesystem: one `write` + `fsync` of the same bytes into one new file; and
a write-back store of them (answered from RAM: the transport alone), so the
part after the transport shows apart, and that write-back store until its
backlog is on disk (spilled). Prints the medians and the ratios
(target: durable <= 1.5x write+fsync). Each daemon's RAM tier is filled
first, so every timed store evicts an older one, as in a daemon that has run
for a while (warm); the first store of each new daemon is printed apart
(fresh: its arena's pages are new memory, see bench_fresh.py). Before
session 49 no daemon was warmed: at 256 MiB every repetition of the default
three landed in a fresh arena. Each timed step starts after `--gap-s`
seconds of an idle disk (3 by default; 0: back to back): this VM's disk
writes 256 MiB in 0.2 s or in 1.2 s depending on what was written in the
seconds before, so back to back each step paid for the one before it
(bench/RESULTS.md, session 49). `--baseline-src DIR` also runs daemons
from another source tree (`git archive REV | tar -x -C DIR`), measured in
turn with this tree's in every repetition: the figures before, under the
same load.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _util import DaemonProcess  # noqa: E402
from support import prefix_snapshot  # noqa: E402


def measure(write_through: bool, clients: int, puts: int) -> tuple[float, float, float]:
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-wt-", dir="/tmp"))
    args = ["--ram-mb", "1024", "--min-free-gb", "0"] + (["--write-through"] if write_through else [])
    d = DaemonProcess(workdir, args).start()
    lat: list[float] = []
    per = puts // clients

    def work(k: int) -> None:
        with d.client("bench-wt", strict=True) as c:
            for i in range(per):
                s = np.arange(256) + 1_000 * (k * per + i)
                snap = prefix_snapshot(s)
                t = time.perf_counter()
                assert c.put(s, snap)
                lat.append(time.perf_counter() - t)

    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = per * clients / (time.perf_counter() - t0)
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    q = statistics.quantiles(lat, n=100)
    return rate, q[49] * 1e3, q[98] * 1e3


def big_store(size_mib: int, reps: int, transport: str, trees: dict[str, str | None],
              gap_s: float = 0.0) -> dict[str, dict[str, float]]:
    """Median seconds, per daemon source tree (name -> PYTHONPATH, None: this
    one), of a write-through PUT of `size_mib` ("durable": answered once on
    disk), of a write-back PUT of them ("acked": the transport alone, answered
    from RAM) and of that PUT until its backlog is written ("spilled", polled
    every 5 ms); and of one write+fsync of as many bytes ("raw", under the
    name ""). The order rotates from one repetition to the next, so every
    figure shares the machine's moods alike."""
    import os

    from kvd_client import HostTensor, Snapshot

    layers, heads, dim = 32, 8, 128  # a llama-8B-like cache: 256 MiB is 2,048 tokens
    tokens = size_mib * (1 << 20) // (layers * 2 * heads * dim * 2)
    raw = np.random.default_rng(size_mib).integers(0, 1 << 16, size=(2 * layers, 1, heads, tokens, dim), dtype=np.uint16)
    snap = Snapshot(sliced={f"{i // 2}.{'kv'[i % 2]}": (HostTensor("bfloat16", raw[i]), 2) for i in range(2 * layers)})
    ram_mb = 2 * size_mib + 256 if size_mib < 2048 else size_mib + 256  # 4 GiB: one resident, on a 24 GiB machine
    warm_puts = ram_mb // size_mib + 1  # then the RAM tier is full: every timed store evicts an older one
    args = ["--ram-mb", str(ram_mb), "--min-free-gb", "0", "--max-message-mb", str(max(512, size_mib + 16))]
    dirs: list[Path] = []
    daemons: list = []
    clients: list = []
    took: dict[str, dict[str, list[float]]] = {"": {"raw": []}}
    steps = []
    try:
        for name, pythonpath in trees.items():
            dirs += [Path(tempfile.mkdtemp(prefix="kvd-bench-big-", dir="/tmp")) for _ in range(2)]
            wt = DaemonProcess(dirs[-2], args + ["--write-through"], pythonpath=pythonpath).start()
            daemons.append(wt)
            wb = DaemonProcess(dirs[-1], args, pythonpath=pythonpath).start()
            daemons.append(wb)
            cwt = wt.client("bench-big", strict=True, timeout=120, transport=transport)
            cwb = wb.client("bench-big", strict=True, timeout=120, transport=transport)
            clients += [cwt, cwb]
            mine = took[name] = {k: [] for k in ("durable", "acked", "spilled", "fresh durable", "fresh spilled",
                                                 "warm-up", "warm-up spilled")}

            def durable(r: int, c=cwt, mine=mine, key="durable") -> None:
                s = np.arange(tokens) + 10_000_000 * (r + 1)
                t = time.perf_counter()
                assert c.put(s, snap)
                mine[key].append(time.perf_counter() - t)

            def acked(r: int, c=cwb, mine=mine, key="") -> None:
                s = np.arange(tokens) + 10_000_000 * (r + 1)
                t = time.perf_counter()
                assert c.put(s, snap)
                if not key:
                    mine["acked"].append(time.perf_counter() - t)
                while c.stats()["store"]["dirty_bytes"]:  # written behind: the spill
                    time.sleep(0.005)
                mine[key + "spilled"].append(time.perf_counter() - t)

            for k in range(warm_puts):  # the first into a new daemon (fresh), the rest fill its RAM tier
                durable(300 + k, key="fresh durable" if k == 0 else "warm-up")
                acked(300 + k, key="fresh " if k == 0 else "warm-up ")
            steps += [durable, acked]

        def write_fsync(r: int) -> None:
            path = dirs[0] / f"raw-{r}"
            t = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            mv = memoryview(raw).cast("B")
            while mv:
                mv = mv[os.write(fd, mv):]
            os.fsync(fd)
            os.close(fd)
            took[""]["raw"].append(time.perf_counter() - t)
            os.unlink(path)

        steps.append(write_fsync)
        for r in range(reps):
            k = r % len(steps)
            for fn in steps[k:] + steps[:k]:
                time.sleep(gap_s)  # the disk idle first, for each step alike (module docstring)
                fn(r)
    finally:
        for c in clients:
            c.close()
        for d in daemons:
            d.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    for name, m in took.items():  # each repetition, in order: the disk's and the machine's moods show
        print(f"{size_mib:>6} {name or 'raw':>8}  " + "  ".join(
            f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in m.items() if v), flush=True)
    return {name: {k: statistics.median(v) for k, v in m.items()} for name, m in took.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--puts", type=int, default=400)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--sizes", default="", help="MiB per store, e.g. 256,1024: big write-through stores instead")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gap-s", type=float, default=3.0,
                    help="seconds the disk is left idle before each timed step (big stores; module docstring)")
    ap.add_argument("--transport", default="shm", choices=["shm", "frames"])
    ap.add_argument("--baseline-src", default=None, help="run the daemons from this source tree (an older kvd)")
    a = ap.parse_args()
    if a.sizes:
        trees = {"this": None}
        if a.baseline_src:
            trees["baseline"] = a.baseline_src
        print(f"{a.transport}, medians of {a.reps} (seconds); durable = a write-through store, answered once on disk;\n"
              f"acked = a write-back store (the transport alone); on disk = durable - acked, the part after the transport;\n"
              f"spilled = that write-back store until its backlog is on disk. Daemons of each tree measured in turn.")
        print("fresh = the first store of a new daemon, write-through (durable) and write-back until on disk (spilled).")
        print(f"{'MiB':>6} {'tree':>8} {'write+fsync':>11} {'durable':>8} {'acked':>6} {'spilled':>8}  {'durable/raw':>11} "
              f"{'on disk/raw':>11} {'spilled/raw':>11}  {'fresh durable':>13} {'fresh spilled':>13}")
        for size in [int(x) for x in a.sizes.split(",")]:
            got = big_store(size, a.reps, a.transport, trees, a.gap_s)
            raw = got[""]["raw"]
            for name in trees:
                m = got[name]
                print(f"{size:>6} {name:>8} {raw:>11.3f} {m['durable']:>8.3f} {m['acked']:>6.3f} {m['spilled']:>8.3f}  "
                      f"{m['durable'] / raw:>10.2f}x {(m['durable'] - m['acked']) / raw:>10.2f}x "
                      f"{m['spilled'] / raw:>10.2f}x  {m['fresh durable'] / raw:>12.2f}x "
                      f"{m['fresh spilled'] / raw:>12.2f}x", flush=True)
        return
    print(f"{'mode':>14} {'clients':>7} {'PUT/s':>8} {'p50 ms':>7} {'p99 ms':>7}  ratio to write-back")
    for n in [int(x) for x in a.clients.split(",")]:
        base = measure(False, n, a.puts)
        wt = measure(True, n, a.puts)
        print(f"{'write-back':>14} {n:>7} {base[0]:>8.0f} {base[1]:>7.2f} {base[2]:>7.2f}")
        print(f"{'write-through':>14} {n:>7} {wt[0]:>8.0f} {wt[1]:>7.2f} {wt[2]:>7.2f}  {wt[0] / base[0]:.2f}x PUT/s")


if __name__ == "__main__":
    main()
