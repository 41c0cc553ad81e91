"""Where the daemon listens, and the lock that keeps it alone there.

ZeroMQ lets a second process bind an ipc endpoint that another already
serves, silently stealing it. So before binding, the daemon takes an
exclusive flock on `<socket path>.lock` (held for its whole life, released
by the kernel if it dies) and only then removes a stale socket file and binds.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

# sun_path is 108 bytes on Linux and 104 on macOS, NUL included.
MAX_IPC_PATH = 103 if sys.platform == "darwin" else 107


class EndpointError(Exception):
    """The endpoint cannot be used (bad form, path too long, already served)."""


def default_endpoint(environ: dict[str, str] | None = None) -> str:
    """The per-user default: KVD_ENDPOINT if set, else an ipc socket in a 0700 dir.

    Linux: $XDG_RUNTIME_DIR/kvd/kvd.sock (or /tmp/kvd-<uid>/kvd.sock without it).
    macOS: ~/Library/Caches/kvd/run/kvd.sock ($TMPDIR is too long for a socket path).
    """
    env = os.environ if environ is None else environ
    if env.get("KVD_ENDPOINT"):
        return env["KVD_ENDPOINT"]
    if sys.platform == "darwin":
        base = Path(env.get("HOME", str(Path.home()))) / "Library" / "Caches" / "kvd" / "run"
    elif env.get("XDG_RUNTIME_DIR") and os.path.isdir(env["XDG_RUNTIME_DIR"]):
        base = Path(env["XDG_RUNTIME_DIR"]) / "kvd"
    else:
        base = Path("/tmp") / f"kvd-{os.getuid()}"
    return f"ipc://{base / 'kvd.sock'}"


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint, or None for other transports."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not path or path.startswith("@"):
            return None  # abstract namespace (Linux): no file, no lock file
        return Path(path)
    if "://" not in endpoint:
        raise EndpointError(f"endpoint {endpoint!r} needs a transport, e.g. ipc:///path or tcp://127.0.0.1:5555")
    return None


class EndpointLock:
    """An exclusive lock on an endpoint, held while the daemon serves it."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.path = ipc_path(endpoint)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Prepare the socket directory and take the lock.

        Raises EndpointError if the path is too long or another daemon holds it.
        """
        if self.path is None:
            return
        if len(str(self.path).encode()) > MAX_IPC_PATH:
            raise EndpointError(
                f"socket path is {len(str(self.path).encode())} bytes; the OS limit is {MAX_IPC_PATH}: "
                f"choose a shorter --endpoint than {self.endpoint}"
            )
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read_pid(lock_path)
                who = f" (pid {holder})" if holder else ""
                raise EndpointError(f"another kvd daemon{who} is already serving {self.endpoint}") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        # We hold the lock, so any socket file left here is a dead daemon's.
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def release(self) -> None:
        if self._fd is None:
            return
        assert self.path is not None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def endpoint_in_use(endpoint: str, *, probe_timeout: float = 0.2) -> bool:
    """Whether a daemon still holds `endpoint`.

    For an ipc endpoint this asks the lock (exact, instant); otherwise it
    pings with a short timeout.
    """
    path = ipc_path(endpoint)
    if path is not None:
        lock_path = path.with_name(path.name + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)
    from kvd_client import Client

    with Client(endpoint, namespace="kvd-admin", timeout=probe_timeout) as client:
        return client.ping() is not None


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None
