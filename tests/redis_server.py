"""A throwaway Redis/Valkey server (or cluster) for the remote-tier tests and benchmarks.

`RedisCluster` joins six of them (three primaries, three replicas) with
`redis-cli --cluster create` and waits for cluster_state:ok everywhere.
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

def remote(client) -> dict:
    """A daemon's remote-tier stats, through `client`."""
    return client.stats()["tiers"]["remote"]


@pytest.fixture(name="server")
def function_server():
    """A server of this test's own (import this into a test module)."""
    s = RedisServer().start()
    yield s
    s.close()


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


CLUSTER_SKIP = "redis-server/redis-cli without cluster support (cluster-enabled, redis-cli --cluster)"


class RedisCluster:
    """Three primaries and three replicas on loopback ports, each a RedisServer
    with cluster mode on, joined by `redis-cli --cluster create`. `start()`
    returns once every node says cluster_state:ok (or raises past its deadline)."""

    def __init__(self, primaries: int = 3, node_timeout_ms: int = 1500):
        self.cli = shutil.which("valkey-cli") or shutil.which("redis-cli")
        if self.cli is None:
            raise RuntimeError(CLUSTER_SKIP)
        self.servers = [
            RedisServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", str(node_timeout_ms), port=_cluster_port())
            for _ in range(2 * primaries)
        ]
        self.primaries = primaries

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self, timeout: float = 30.0) -> "RedisCluster":
        for s in self.servers:
            # A port pair free when it was picked can be taken before the node
            # binds it (another test's server or connection): a new pair then.
            for attempt in range(5):
                try:
                    s.start()
                    break
                except RuntimeError as err:
                    if "Address already in use" not in str(err) or attempt == 4:
                        raise
                    s.port = _cluster_port()
        addrs = [f"127.0.0.1:{s.port}" for s in self.servers]
        done = subprocess.run([self.cli, "--cluster", "create", *addrs, "--cluster-replicas", "1", "--cluster-yes"],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-1000:]} {done.stderr[-1000:]}")
        self.wait_ok(timeout)
        return self

    def alive(self) -> list[RedisServer]:
        return [s for s in self.servers if s.proc is not None and s.proc.poll() is None]

    def info(self, server: RedisServer) -> dict[str, str]:
        info = server.client().execute_command("CLUSTER INFO")  # redis-py parses it into a dict
        return {k: str(v) for k, v in info.items()}

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and knows all 16384 slots as ok."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self.info(s).get("cluster_state") == "ok" and self.info(s).get("cluster_slots_ok") == "16384"
                       for s in self.alive()) and len(self.roles()[0]) == self.primaries and all(
                           s.client().info("replication").get("master_link_status") == "up" for s in self.roles()[1]):
                    return
            except Exception:  # noqa: BLE001 - a node still starting
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout}s")
            time.sleep(0.1)

    def roles(self) -> tuple[list[RedisServer], list[RedisServer]]:
        """(primaries, replicas) among the live nodes, as each says of itself."""
        prim, repl = [], []
        for s in self.alive():
            role = s.client().execute_command("ROLE")[0]
            (prim if role in (b"master", "master") else repl).append(s)
        return prim, repl

    def node_id(self, server: RedisServer) -> str:
        return server.client().execute_command("CLUSTER MYID").decode()

    def close(self) -> None:
        for s in self.servers:
            s.close()


def _cluster_port() -> int:
    """A free port P whose bus port P + 10000 is free too (a cluster node
    needs both), both below the kernel's ephemeral ports where there is room
    (the ports connections and `free_port` get, which took a bus port between
    its pick and its node's start once in a run of the suite)."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 0
    lo, hi = (10000, ephemeral - 10001) if ephemeral >= 22000 else (20000, 45000)
    for _ in range(200):
        port = random.randint(lo, hi)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def cluster_supported() -> bool:
    """redis-server and redis-cli that can make a cluster (Redis >= 5, or Valkey)."""
    binary = redis_binary()
    cli = shutil.which("valkey-cli") or shutil.which("redis-cli")
    if binary is None or cli is None:
        return False
    done = subprocess.run([cli, "--cluster", "help"], capture_output=True, text=True)
    return "create" in done.stdout + done.stderr
