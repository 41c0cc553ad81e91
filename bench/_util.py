"""Small helpers shared by the benchmark scripts and examples (timing, the one daemon launcher)."""

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
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    return f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, {sys.platform}"
