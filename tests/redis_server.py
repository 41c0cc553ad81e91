"""A throwaway Redis/Valkey server for the remote-tier tests and benchmarks.

`RedisServer` runs the real `valkey-server` or `redis-server` binary on a
free loopback port with a temporary dir, no persistence, and waits for it to
answer PING (polling the socket, with a deadline). `redis_binary()` is None
when neither is installed; the fixture in test_remote_*.py skips then.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from support import free_port

def session_key():
    """The remote key every test daemon reads (conftest writes it in the sandbox's keys dir)."""
    from kvd.endpoint import read_remote_key, remote_key_path

    return read_remote_key(remote_key_path(None, None))


SKIP_REASON = "no redis-server or valkey-server on PATH (.ci/run installs Debian's redis-server)"


def redis_binary() -> str | None:
    return shutil.which("valkey-server") or shutil.which("redis-server")


def ping(port: int, timeout: float = 0.2) -> bool:
    """True if a server on 127.0.0.1:port answers PING with +PONG."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One server process; `stop()` kills it, `start()` brings it back on the same port."""

    def __init__(self, *extra: str, port: int | None = None, password: str | None = None):
        binary = redis_binary()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self.binary = binary
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvd-redis-", dir="/tmp"))
        self.password = password
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f"default:{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
               "--save", "", "--appendonly", "no", *self.extra]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=open(self.dir / "server.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.binary} did not answer PING in {timeout}s: {self.log()}")
            time.sleep(0.02)
        return self

    def _answers(self) -> bool:
        if not self.password:
            return ping(self.port)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                time.sleep(0)  # both replies arrive together or in two reads
                data = b""
                while b"PONG" not in data and len(data) < 64:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    data += chunk
                return b"PONG" in data
        except OSError:
            return False

    def log(self) -> str:
        try:
            return (self.dir / "server.log").read_text(errors="replace")[-2000:]
        except FileNotFoundError:
            return ""

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module", name="server")
def module_server():
    """One server for a test module (import this into it)."""
    s = RedisServer().start()
    yield s
    s.close()


def write_entries(url: str, entries) -> None:
    """Store `entries` on the server at `url` as a daemon's write-behind does, and wait for it."""
    from kvd.store.remote.tier import RemoteTier

    writer = RemoteTier(url, auth=session_key(), timeout=5.0)
    try:
        for e in entries:
            writer.offer(e)
        assert writer.flush(30)
    finally:
        writer.close()
