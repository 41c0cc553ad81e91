"""Small helpers shared by the benchmark scripts (timing, a throwaway daemon)."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

GiB = float(1 << 30)
MiB = 1 << 20


def median_time(fn, reps: int, setup=None) -> float:
    """Median wall time of fn() over reps runs (setup() before each, untimed)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextmanager
def daemon(*args: str):
    """A `kvd serve` process on a temporary ipc socket; yields its endpoint."""
    from kvd_client import Client

    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-", dir="/tmp"))
    endpoint = f"ipc://{workdir / 'kvd.sock'}"
    log = open(workdir / "daemon.log", "wb")
    if "--data-dir" not in args:  # never the user's real cache
        args = (*args, "--data-dir", str(workdir / "data"))
    proc = subprocess.Popen([sys.executable, "-m", "kvd", "serve", "--endpoint", endpoint, *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        with Client(endpoint, namespace="bench", timeout=0.5) as c:
            deadline = time.monotonic() + 20
            while c.ping() is None:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((workdir / "daemon.log").read_text())
                time.sleep(0.05)
        yield endpoint, workdir
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def machine() -> str:
    return f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, {sys.platform}"
