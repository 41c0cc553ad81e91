"""Endpoint policy: the one place that says where a daemon listens.

Everything that names an endpoint imports this module and nothing else for
it: the settings table (`kvd.config`), the daemon (`kvd.server`), the client
(`kvd_client`) and the command line. It sits beside `kvd.protocol` at the
bottom of the layers and imports neither the server nor the client.

Rules it keeps:
1. An endpoint is `ipc://<path>` or `tcp://<host>:<port>`; anything else is
   an `EndpointError` before a socket is made (ZeroMQ would raise a bare
   ZMQError, or in the client's case fail on first use).
2. An ipc socket path fits in sun_path (108 bytes on Linux, 104 on macOS,
   NUL included); a longer one is refused up front, not truncated.
3. The per-user default is an ipc socket in a 0700 directory of the user:
   `$XDG_RUNTIME_DIR/kvd/kvd.sock` (Linux; `/tmp/kvd-<uid>/` without it),
   `~/Library/Caches/kvd/run/kvd.sock` (macOS: `$TMPDIR` is too long).
4. ZeroMQ lets a second process bind an ipc endpoint another already serves,
   silently stealing it. So before binding, the daemon takes an exclusive
   flock on `<socket path>.lock` (held for its whole life, released by the
   kernel if it dies) and only then removes a stale socket file and binds.
   The same lock answers "is a daemon there?" without a round trip.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

from kvd.protocol.errors import KvdError

# sun_path is 108 bytes on Linux and 104 on macOS, NUL included.
MAX_IPC_PATH = 103 if sys.platform == "darwin" else 107
TRANSPORTS = ("ipc", "tcp")


class EndpointError(KvdError):
    """The endpoint cannot be used: bad form, path too long, or already served."""

    name = "ENDPOINT"


class EndpointBusy(EndpointError):
    """Another kvd daemon is already serving the endpoint."""

    name = "ENDPOINT_BUSY"


def default_endpoint(environ: dict[str, str] | None = None) -> str:
    """The per-user default: KVD_ENDPOINT if set, else an ipc socket in a 0700 dir (rule 3)."""
    env = os.environ if environ is None else environ
    if env.get("KVD_ENDPOINT"):
        return env["KVD_ENDPOINT"]
    if sys.platform == "darwin":
        base = Path(env.get("HOME", str(Path.home()))) / "Library" / "Caches" / "kvd" / "run"
    elif env.get("XDG_RUNTIME_DIR") and os.path.isdir(env["XDG_RUNTIME_DIR"]):
        return runtime_endpoint(env["XDG_RUNTIME_DIR"])
    else:
        base = Path("/tmp") / f"kvd-{os.getuid()}"
    return f"ipc://{base / 'kvd.sock'}"


def runtime_endpoint(runtime_dir: str | os.PathLike) -> str:
    """The socket in a user's runtime dir ($XDG_RUNTIME_DIR): where a systemd user unit binds."""
    return f"ipc://{Path(runtime_dir) / 'kvd' / 'kvd.sock'}"


def check_endpoint(endpoint: str) -> str:
    """Return `endpoint` if kvd can use it (rules 1, 2); raise EndpointError saying why not."""
    transport, sep, rest = endpoint.partition("://")
    if not sep or transport not in TRANSPORTS or not rest:
        raise EndpointError(
            f"endpoint {endpoint!r} is not ipc:///path/to/socket or tcp://host:port"
        )
    path = ipc_path(endpoint)
    if path is not None and len(str(path).encode()) > MAX_IPC_PATH:
        raise EndpointError(
            f"socket path {path} is {len(str(path).encode())} bytes; the OS limit is {MAX_IPC_PATH}: "
            "choose a shorter endpoint"
        )
    return endpoint


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint, or None for other transports
    and Linux abstract sockets (`ipc://@name`, which have no file)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    if not path or path.startswith("@"):
        return None
    return Path(path)


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


class EndpointLock:
    """An exclusive lock on an endpoint, held while the daemon serves it (rule 4)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.path = ipc_path(endpoint)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Check the endpoint, prepare the socket directory and take the lock.

        Raises EndpointError for an endpoint kvd cannot use, EndpointBusy if
        another daemon holds it.
        """
        check_endpoint(self.endpoint)
        if self.path is None:
            return
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_path = _lock_path(self.path)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read_pid(lock_path)
                who = f" (pid {holder})" if holder else ""
                raise EndpointBusy(f"another kvd daemon{who} is already serving {self.endpoint}") from None
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


def endpoint_locked(endpoint: str) -> bool | None:
    """Whether a daemon holds `endpoint`'s lock: exact and instant for an ipc
    endpoint; None for the others, which have no lock (ask the daemon then)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    try:
        fd = os.open(_lock_path(path), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None
