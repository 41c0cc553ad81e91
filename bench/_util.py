"""Small helpers shared by the benchmark scripts and examples (timing, the one
daemon launcher, the memory a run may take, why a read came back short, and
the issue-42 verdict lines)."""

from __future__ import annotations

import os
import shutil
import signal
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
    return statistics.median(times_of(fn, reps, setup))


def times_of(fn, reps: int, setup=None) -> list[float]:
    """Wall times of fn() over reps runs (setup() before each, untimed)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def room_for(need: int, what: str) -> bool:
    """Whether `need` bytes are available now; if not, say so (the caller
    skips that size: a 4 GiB run on a shared 24 GiB machine must not push the
    daemon's RAM tier into yielding to memory pressure, which a fetch then
    reports as served short)."""
    avail = mem_available()
    if avail is None or avail >= need:
        return True
    print(f"{what}: skipped, needs ~{need / GiB:.1f} GiB available, {avail / GiB:.1f} GiB are (free -g)", flush=True)
    return False


def short_reason(counters: dict, stats: dict | None) -> str:
    """Why a get or fetch served fewer tokens than were stored, from the
    client's counters and the daemon's STATS (bench_mlx, bench_wire).

    The causes seen at 4 GiB on this machine, each a limit, not a fault:
      * the copy out of shared memory outlasted the read lease (`shm_lease_s`,
        30 s by default; the client then throws the copy away: a miss,
        counter `shm_late`): on this VM a first touch of memory the kernel
        handed back to the host runs at ~0.3 GiB/s, so a 4 GiB fetch can take
        longer than that on a loaded machine;
      * the RAM tier yielded to memory pressure (`pressure_source`; it shrinks
        when MemAvailable falls under 10% of RAM) between the pages of a GET:
        the first page (512 MiB, `max_message_mb`) is served, the next chunk is
        gone, and the hit ends there (4,096 of 32,768 tokens at 4 GiB);
      * the RAM tier's budget (`ram_mb`) evicted the entry.
    """
    why = []
    if counters.get("shm_late"):
        why.append(f"{counters['shm_late']} copies outlasted the shm read lease (shm_lease_s)")
    if counters.get("shm_damaged"):
        why.append(f"{counters['shm_damaged']} damaged in shared memory")
    pressure = (stats or {}).get("pressure") or {}
    cut = pressure.get("ram_budget_bytes", 0) < pressure.get("ram_max_bytes", 0)
    if pressure.get("evictions") or cut or pressure.get("shrinks"):
        why.append(f"the RAM tier yielded to memory pressure (budget {pressure.get('ram_budget_bytes', 0) / MiB:.0f} "
                   f"of {pressure.get('ram_max_bytes', 0) / MiB:.0f} MiB after {pressure.get('shrinks', 0)} shrinks, "
                   f"{pressure.get('evictions', 0)} entries evicted by it; now {pressure.get('level')}: "
                   f"{pressure.get('reason')})")
    counts = ((stats or {}).get("evictions") or {}).get("counts") or {}
    ram = ((stats or {}).get("tiers") or {}).get("ram") or {}
    lost = {k: ram[k] for k in ("dropped", "too_big", "altered") if ram.get(k)}
    if counts or lost:
        why.append(f"the daemon's RAM tier let entries go (evictions by cause {dict(counts)}"
                   + (f", {lost}" if lost else "") + f"; it holds {ram.get('bytes', 0) / MiB:.0f} of "
                   f"{ram.get('budget_bytes', 0) / MiB:.0f} MiB)")
    if counters.get("error_out_of_time") or counters.get("error_unavailable"):
        why.append("a request ran out of time (Client timeout)")
    seen = {k: v for k, v in counters.items()
            if v and any(w in k for w in ("miss", "error", "fail", "late", "fallback", "unbeliev", "invalid", "abandon"))}
    return "; ".join(why) or f"cause not named by the counters ({seen or 'none'}; see the daemon's log)"


def ratio_verdict(label: str, value: float, limit: float, *, at_most: bool) -> str:
    """'label 1.21x (<= 1.3x: met)' -- nan (not measured) says so."""
    if value != value:  # nan
        return f"{label} n/a"
    ok = value <= limit if at_most else value >= limit
    return f"{label} {value:.2f}x ({'<=' if at_most else '>='} {limit}x: {'met' if ok else 'NOT met'})"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


class DaemonProcess:
    """A `python -m kvd serve` child process on an ipc socket in `workdir`, and
    how to reach it: the one daemon launcher of the benches, the examples and
    the test fixtures (tests/conftest.py).

    It never reads the user's settings: an empty config file, no KVD_*
    variables, and a data dir in `workdir` unless `args` name one.
    `python` runs another interpreter's kvd (cwd is `workdir`, outside any
    checkout, so `-m kvd` is the kvd that interpreter has installed);
    `pythonpath` puts another source tree first (a baseline build).
    """

    namespace = "bench"  # client()'s default

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None, *,
                 python: str = sys.executable, pythonpath: str | None = None):
        self.workdir = workdir
        self.endpoint = f"ipc://{workdir / 'kvd.sock'}"
        self.data_dir = workdir / "data"
        self.log_path = workdir / "daemon.log"
        self.config = workdir / "kvd.toml"
        self.config.touch()
        self.args = list(args)
        self.python = python
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        if pythonpath:
            self.env["PYTHONPATH"] = pythonpath
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        args = list(self.args)
        if "--data-dir" not in args:  # never the user's real cache
            args += ["--data-dir", str(self.data_dir)]
        return [self.python, "-m", "kvd", "serve", "--endpoint", self.endpoint, "--config", str(self.config), *args]

    def start(self, wait: bool = True, timeout: float = 30.0) -> "DaemonProcess":
        """Start it; with `wait`, return once it answers a PING (RuntimeError
        with its log if it exits or is not ready within `timeout` s)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.workdir)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        from kvd_client import Client

        deadline = time.monotonic() + timeout
        # The socket file appears when the daemon binds: ping only then, so
        # the first ping is not refused (a refused client backs off 0.25 s).
        sock = Path(self.endpoint[len("ipc://"):]) if self.endpoint.startswith("ipc://") else None
        while sock is not None and not sock.exists() and time.monotonic() < deadline:
            self._alive()
            time.sleep(0.01)
        with Client(self.endpoint, namespace="probe", timeout=0.5) as c:
            while time.monotonic() < deadline:
                self._alive()
                if c.ping() is not None:
                    return
                time.sleep(0.05)
        raise RuntimeError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def _alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def client(self, namespace: str | None = None, **kw):
        from kvd_client import Client

        kw.setdefault("timeout", 5.0)
        return Client(self.endpoint, namespace=namespace or self.namespace, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Signal it and wait up to `timeout` s (then SIGKILL); its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        return code

    def kill(self, *, keep_socket: bool = False) -> None:
        """SIGKILL it; its ipc socket file goes too unless `keep_socket`."""
        self.stop(signal.SIGKILL)
        if not keep_socket and self.endpoint.startswith("ipc://"):
            # The dead daemon's socket file would look like readiness to
            # wait_ready after a restart; the new daemon makes its own.
            Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)

    def restart(self) -> "DaemonProcess":
        """A clean stop, then a start on the same endpoint and data dir."""
        self.stop()
        return self.start()


@contextmanager
def daemon(*args: str, **kw):
    """A started DaemonProcess (keywords as its constructor's) in a fresh 0700
    folder under /tmp (ipc paths are short); stopped and removed after."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-", dir="/tmp"))  # mkdtemp makes it 0700
    d = DaemonProcess(workdir, list(args), **kw)
    try:
        yield d.start()
    finally:
        d.stop(timeout=20)
        shutil.rmtree(workdir, ignore_errors=True)


def machine() -> str:
    from kvd.host.select import mechanism

    return (f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, {sys.platform}; "
            f"shared-memory pages {mechanism('shared_memory_pages')}")


def kv_cache(tokens: int, layers: int = 32, heads: int = 8, dim: int = 128):
    """An mlx-lm prompt cache of `layers` KVCaches holding `tokens` tokens of
    random bf16 keys (values = keys + 1): 32 x 8 x 128 is 128 KiB a token."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    caches = []
    for i in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(i)).astype(mx.bfloat16)
        c.update_and_fetch(k, k + 1)
        caches.append(c)
        mx.eval(c.state)
    return caches
