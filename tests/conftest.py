"""Shared fixtures: a real `kvd serve` process on a throwaway socket.

`kvd_daemon` starts one daemon per test; `daemon_factory` starts several or
with extra flags. Each daemon gets its own short socket directory under /tmp
(ipc paths are limited to ~104 bytes, and pytest's tmp_path can be longer)
and its own data dir. The daemon's log is printed if a test fails to start it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvd_client import Client

# Nothing a test starts may read or write the user's real cache, config or
# runtime dirs: point the per-user defaults at a throwaway folder for the
# whole session (child processes inherit it).
_SANDBOX = Path(tempfile.mkdtemp(prefix="kvd-test-home-", dir="/tmp"))
for _var in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
    os.environ[_var] = str(_SANDBOX / _var.lower())
os.environ.pop("KVD_CONFIG", None)


def _session_remote_key() -> None:
    """remote.key in the sandbox's default keys dir: every daemon a test starts
    with a remote_url signs and checks with it, as daemons sharing a tier do
    (a test wanting another key passes --remote-key-file)."""
    from kvd.endpoint import default_keys_dir, ensure_keys_dir, remote_key_path, write_remote_key

    ensure_keys_dir(default_keys_dir())
    write_remote_key(remote_key_path(None, None))


_session_remote_key()


def pytest_unconfigure(config):
    shutil.rmtree(_SANDBOX, ignore_errors=True)


class DaemonProcess:
    """A `python -m kvd serve` child process and how to reach it."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None):
        self.workdir = workdir
        self.endpoint = f"ipc://{workdir / 'kvd.sock'}"
        self.data_dir = workdir / "data"
        self.log_path = workdir / "daemon.log"
        self.config = workdir / "kvd.toml"  # empty: tests never read the user's config file
        self.config.touch()
        self.args = args
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        args = list(self.args)
        if "--data-dir" not in args:  # never touch the user's real cache dir
            args += ["--data-dir", str(self.data_dir)]
        return [sys.executable, "-m", "kvd", "serve", "--endpoint", self.endpoint, "--config", str(self.config), *args]

    def start(self, wait: bool = True) -> "DaemonProcess":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        # The socket file appears when the daemon binds: ping only then, so
        # the first ping is not refused (a refused client backs off 0.25 s).
        sock = Path(self.endpoint[len("ipc://"):]) if self.endpoint.startswith("ipc://") else None
        while sock is not None and not sock.exists() and time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.01)
        with Client(self.endpoint, namespace="probe", timeout=0.5) as c:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
                if c.ping() is not None:
                    return
                time.sleep(0.05)
        raise RuntimeError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def client(self, namespace: str = "test", **kw) -> Client:
        kw.setdefault("timeout", 5.0)
        return Client(self.endpoint, namespace=namespace, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
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
        self.stop(signal.SIGKILL)
        if not keep_socket:
            # The dead daemon's socket file would look like readiness to
            # wait_ready after a restart; the new daemon makes its own.
            if self.endpoint.startswith("ipc://"):
                Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)

    def restart(self) -> "DaemonProcess":
        self.stop()
        return self.start()


@pytest.fixture
def daemon_factory():
    started: list[DaemonProcess] = []
    dirs: list[str] = []

    def make(*args: str, start: bool = True, workdir: Path | None = None, env: dict | None = None) -> DaemonProcess:
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
            dirs.append(str(workdir))
        d = DaemonProcess(workdir, list(args), env)
        started.append(d)
        if start:
            d.start()
        return d

    yield make
    from kvd.server.shm.folders import plane_dirs

    for d in started:
        d.stop()
        # A daemon a test killed -9 leaves its shared-memory segments until
        # the next start on its endpoint, which a temp endpoint never sees.
        for folder in plane_dirs(d.workdir / "kvd.sock"):
            shutil.rmtree(folder, ignore_errors=True)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kvd_daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory("--ram-mb", "256")
