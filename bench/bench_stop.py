"""How long SIGTERM takes with a large write-back RAM tier, and what it persists.

One command:

    .venv/bin/python bench/bench_stop.py [--entries 131072] [--stop-timeout 10]
                                          [--drain] [--baseline-src DIR] [--baseline-entries N]

Offers a real `kvd serve` (write-back, RAM tier big enough for everything)
`--entries` small chunks (16 tokens, ~0.5 KiB each) as fast as a client can
PUT them (the daemon refuses PUTs BUSY while its backlog would take a stop
longer to write than stop_timeout leaves it, docs/durability.md: counted),
sends SIGTERM at once, and reports
how long the process took to exit, how many entries it said it could not
persist, and how many a restart serves against how many were acknowledged. `--baseline-src` runs the same against another kvd source tree (e.g.
`git archive <commit> | tar -x -C /tmp/old`) -- the daemon before this change,
which wrote the whole RAM tier down at stop -- and prints the ratio of the two
stop times (on `--baseline-entries`, since the old stop grows with the tier).
`--drain` waits until the write-behind backlog is empty before SIGTERM (the
usual case for a daemon that is not being filled at that moment).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import DaemonProcess  # noqa: E402

from kvd_client import Client, HostTensor, Snapshot  # noqa: E402

CHUNK = 16
SEQ_CHUNKS = 2048  # chunks per PUT sequence


def _snapshot(tokens: np.ndarray, seed: int) -> Snapshot:
    raw = np.random.default_rng(seed).integers(0, 1 << 16, size=(1, 2, len(tokens), 8), dtype=np.uint16)
    return Snapshot(sliced={"kv": (HostTensor.bfloat16(raw), 2)})


def run(entries: int, stop_timeout: float, src: str | None, label: str, drain: bool = False) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-stop-", dir="/tmp"))
    try:
        args = ["--ram-mb", str(max(256, entries * 2 // 1024)), "--ssd-gb", "64", "--min-free-gb", "0"]
        if src is None:
            args += ["--stop-timeout", str(stop_timeout)]
        d = DaemonProcess(workdir, args, pythonpath=src).start(timeout=60)
        seqs = (entries + SEQ_CHUNKS - 1) // SEQ_CHUNKS
        t0 = time.monotonic()
        acked = refused = 0
        # Not strict: a PUT the daemon refuses (BUSY: the disk is behind) is False, and counted.
        with Client(d.endpoint, namespace="bench-stop", chunk_tokens=CHUNK, timeout=120) as c:
            for i in range(seqs):
                n = min(SEQ_CHUNKS, entries - i * SEQ_CHUNKS) * CHUNK
                tokens = np.arange(n, dtype=np.int64) + 10_000_000 * (i + 1)
                if c.put(tokens, _snapshot(tokens, i)):
                    acked += n // CHUNK
                else:
                    refused += 1
            fill = time.monotonic() - t0
            st = c.stats()
            if drain:  # let the writer catch up first: the stop then has nothing left to write
                deadline = time.monotonic() + 900
                while st["store"].get("dirty_entries", 0) and time.monotonic() < deadline:
                    time.sleep(0.5)
                    st = c.stats()
        ram = st["tiers"]["ram"]["entries"]
        on_disk_at_stop = st["tiers"]["ssd"]["entries"]
        t0 = time.monotonic()
        code = d.stop(timeout=3600)
        stop = time.monotonic() - t0
        log = d.log()
        m = re.search(r"stop: (\d+) entries", log)
        lost = int(m.group(1)) if m else 0
        again = DaemonProcess(workdir, ["--ram-mb", "16", "--ssd-gb", "64", "--min-free-gb", "0"], pythonpath=src)
        with again.start(timeout=60).client("x", timeout=30) as c:
            served = c.stats()["tiers"]["ssd"]["entries"]
        again.stop(timeout=3600)
        out = dict(label=label, entries=ram, fill_s=fill, on_disk_at_sigterm=on_disk_at_stop, stop_s=stop,
                   exit=code, not_persisted=lost, after_restart=served, acked=acked, refused=refused)
        print(
            f"{label:>9}: {acked} chunks acknowledged ({refused} PUTs of {SEQ_CHUNKS} refused BUSY), {ram} in RAM "
            f"(filled in {fill:5.1f} s, {on_disk_at_stop} on disk at SIGTERM); SIGTERM -> exit {code} in {stop:6.2f} s; "
            f"logged not persisted: {lost}; served after restart: {served} ({served - acked:+d} vs acknowledged)",
            flush=True,
        )
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=131072)
    ap.add_argument("--stop-timeout", type=float, default=10.0)
    ap.add_argument("--drain", action="store_true", help="SIGTERM only once the write-behind backlog is empty")
    ap.add_argument("--baseline-src", help="another kvd source tree to run the same against (the old stop)")
    ap.add_argument("--baseline-entries", type=int, default=None, help="entries for the baseline run (default: --entries)")
    a = ap.parse_args()
    now = run(a.entries, a.stop_timeout, None, "drained" if a.drain else "this kvd", a.drain)
    print(f"stop took {now['stop_s'] / a.stop_timeout:.2f}x stop_timeout ({a.stop_timeout:g} s)")
    if a.baseline_src:
        n = a.baseline_entries or a.entries
        if n != a.entries:
            now = run(n, a.stop_timeout, None, "this kvd")
        old = run(n, a.stop_timeout, a.baseline_src, "baseline")
        print(f"at {n} entries: stop {old['stop_s']:.2f} s before, {now['stop_s']:.2f} s now: "
              f"{old['stop_s'] / max(now['stop_s'], 1e-9):.1f}x faster; "
              f"persisted {old['after_restart']} before, {now['after_restart']} now")


if __name__ == "__main__":
    main()
