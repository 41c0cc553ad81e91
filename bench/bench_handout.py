"""How a client gets a segment's fd: a memfd through its /proc symlink (the
Linux auto host) against an fd handed over by the daemon's hand-out service
(SCM_RIGHTS; shm_open segments on the portable host, macOS's mechanism).

    python bench/bench_handout.py [--reps 2000] [--rounds 5]

Two daemons, one per host, each holding a few segments; the client's own
opener (kvd_client._shm.Link._open, what a first GET or SLOTS runs per
segment) opens segment 0 `reps` times per round; prints the median of the
rounds' per-open times and the ratio of the hand-out to the symlink, both
measured in the same run. A client opens each segment once per daemon run
(mappings are kept), so either cost is paid a few times per client, not per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from _util import daemon, machine


def _per_open(d, reps: int, rounds: int) -> float:
    from kvd_client._shm import Link
    from kvd_client._tensors import HostTensor, Snapshot

    toks = np.arange(512)
    snap = Snapshot({"k": (HostTensor.from_numpy(np.ones((1, 512, 64), np.float32)), 1)})
    with d.client("b", strict=True, transport="shm") as c:
        assert c.put(toks, snap) and c.counters["shm_puts"] == 1
        link = c._link()
        name = f"kvd-{link.run}-0"
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                os.close(link._open(name, os.O_RDWR, memfd=True))
            times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"bench_handout: {machine()}; {args.reps} opens x {args.rounds} rounds, medians")
    with daemon("--ram-mb", "64", "--data-dir", "none") as auto:
        link = _per_open(auto, args.reps, args.rounds)
    with daemon("--ram-mb", "64", "--data-dir", "none", env={"KVD_HOST": "portable"}) as portable:
        handed = _per_open(portable, args.reps, args.rounds)
    print(f"memfd via /proc symlink (auto host):      {link * 1e6:8.1f} us per fd")
    print(f"shm_open via the fd hand-out (portable):   {handed * 1e6:8.1f} us per fd")
    print(f"ratio hand-out / symlink: {handed / link:.1f}x")


if __name__ == "__main__":
    main()
