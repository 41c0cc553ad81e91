"""Endpoint policy: the one place that says where a daemon listens.

Everything that names an endpoint imports this module and nothing else for
it: the settings table (`kvd.config`), the daemon (`kvd.server`), the client
(`kvd_client`) and the command line. It sits beside `kvd.protocol` at the
bottom of the layers and imports neither the server nor the client.

Rules it keeps:
1. An endpoint is `ipc://<path>` or `tcp://<host>:<port>`; anything else is
   an `EndpointError` before a socket is made (ZeroMQ would raise a bare
   ZMQError, or in the client's case fail on first use). A Linux abstract
   socket (`ipc://@name`) is refused too: with no file it has no owner or
   mode, so nothing would keep another user from either end of it.
2. An ipc socket path fits in sun_path (108 bytes on Linux, 104 on macOS,
   NUL included); a longer one is refused up front, not truncated.
3. The per-user default is an ipc socket in a 0700 run directory of the
   user: `$XDG_RUNTIME_DIR/kvd/kvd.sock` (Linux, when it is set); else
   `$XDG_CACHE_HOME/kvd/run/kvd.sock` or `~/.cache/kvd/run/kvd.sock` (Linux),
   `~/Library/Caches/kvd/run/kvd.sock` (macOS: `$TMPDIR` is too long). Only
   when that path does not fit in sun_path, `/tmp/kvd-<uid>/kvd.sock`: a
   shared /tmp is the last resort, because another user can create
   `/tmp/kvd-<uid>` first (rule 5 is what makes even that safe).
5. A default run directory is trusted only if `lstat` shows a real directory
   (not a symlink), owned by this uid, with no group or other permission bits.
   The daemon, the client and every `kvd` command check it before use
   (`check_run_dir`) and refuse with UnsafeEndpoint naming the path and the
   fault; nobody "repairs" a directory another user may own. A socket file is
   used only if it is a socket owned by this uid (`check_socket`), on every
   ipc endpoint, default or not; and a connection only if its peer runs as
   this uid or root (`peer_uid`; the client checks each one it makes, since
   one made in the background outlives the path it was made to). The daemon creates the directory 0700 and
   binds inside it under umask 077 (`kvd serve` sets it at start), so the
   socket never exists with a mode another user could use: there is no
   chmod after bind, and no window.
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
import stat
import sys
import time
from pathlib import Path
from typing import Callable

from kvd.host.dirs import MAX_IPC_PATH, config_dir, run_dirs
from kvd.host.segments import memory_folder
from kvd.protocol.errors import KvdError

# sun_path is 108 bytes on Linux and 104 on macOS, NUL included.
TRANSPORTS = ("ipc", "tcp")


class EndpointError(KvdError):
    """The endpoint cannot be used: bad form, path too long, or already served."""

    name = "ENDPOINT"


class EndpointBusy(EndpointError):
    """Another kvd daemon is already serving the endpoint."""

    name = "ENDPOINT_BUSY"


class UnsafeEndpoint(EndpointError):
    """The endpoint's run directory or socket file may be another user's (rule 5)."""

    name = "UNSAFE_ENDPOINT"


def default_endpoint(environ: dict[str, str] | None = None) -> str:
    """The per-user default: KVD_ENDPOINT if set, else an ipc socket in a 0700 dir (rule 3)."""
    env = os.environ if environ is None else environ
    if env.get("KVD_ENDPOINT"):
        return env["KVD_ENDPOINT"]
    return f"ipc://{default_run_dirs(env)[0] / 'kvd.sock'}"


# What a run's hand-out socket adds to the socket's path where the plane's
# folder sits beside it: `<socket>.shm-<16 hex>/fds` (kvd/server/shm/folders.py,
# handout.py; tests/client/test_endpoint_safety.py checks it against the real path).
PLANE_SOCKET_EXTRA = len(".shm-") + 16 + len("/fds")


def default_run_dirs(environ: dict[str, str] | None = None) -> list[Path]:
    """The run directories rule 3 may choose for this user, the chosen one first.

    Every one of them is checked by rule 5 when an endpoint's socket lies in it.
    """
    env = os.environ if environ is None else environ
    dirs = run_dirs(env)  # kvd/host/dirs.py: XDG on Linux, ~/Library on macOS
    # sun_path is short: a deep home dir may not fit, and then only /tmp does.
    # Where no folder is memory (macOS), a run's shared-memory folder sits
    # beside the socket with its hand-out socket in it, which must fit too.
    extra = 0 if memory_folder() is not None else PLANE_SOCKET_EXTRA
    usable = [d for d in dirs if len(str(d / "kvd.sock").encode()) + extra <= MAX_IPC_PATH]
    tmp = Path("/tmp") / f"kvd-{os.getuid()}"
    return usable + [d for d in dirs if d not in usable] + [tmp] if usable else [tmp, *dirs]


def is_default_run_dir(path: Path, environ: dict[str, str] | None = None) -> bool:
    """Whether `path` is one of this user's default run directories (rule 5 applies)."""
    return Path(path) in default_run_dirs(environ)


def _check_ours(path: Path, what: str, kind: Callable[[int], str | None], private: str | None,
                *, missing_ok: bool = True) -> None:
    """The one owner and mode check rules 5 and 6 make: raise UnsafeEndpoint
    unless `path` is of the right kind (`kind` gives the fault for a wrong
    st_mode, or None), owned by this uid and, if `private` says what the bits
    would let other users do, with no group or other permission bits. lstat,
    never stat: a symlink is judged as itself. A missing file passes if
    `missing_ok` (whoever creates it creates it ours)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if missing_ok:
            return
        raise UnsafeEndpoint(f"refusing {what} {path}: it does not exist") from None
    except OSError as exc:  # EACCES: a parent we may not search is not ours either
        raise UnsafeEndpoint(f"refusing {what} {path}: cannot inspect it ({exc.strerror})") from None
    uid = os.getuid()
    fault = kind(st.st_mode)
    if fault is None and st.st_uid != uid:
        fault = f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    if fault is None and private is not None and st.st_mode & 0o077:
        fault = f"has mode {stat.S_IMODE(st.st_mode):04o}: {private}"
    if fault is not None:
        raise UnsafeEndpoint(f"refusing {what} {path}: it {fault}")


def _directory(mode: int) -> str | None:
    if stat.S_ISLNK(mode):
        return "is a symbolic link, not a directory"
    return None if stat.S_ISDIR(mode) else "is not a directory"


def check_run_dir(path: Path) -> None:
    """Raise UnsafeEndpoint unless `path` is missing or a private directory of
    ours (rule 5): whoever creates a missing one creates it 0700."""
    _check_ours(path, "the kvd run directory", _directory, "other users may use it (chmod 700 it if it is yours)")


def check_socket(path: Path) -> None:
    """Raise UnsafeEndpoint unless `path` is missing or a socket owned by us (rule 5)."""
    _check_ours(path, "the kvd socket", lambda mode: None if stat.S_ISSOCK(mode) else "is not a socket", None)


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
    if endpoint.startswith("ipc://@"):
        # Linux abstract sockets have no file, so no owner or mode: any user
        # could connect to the daemon, or serve the name first and take what
        # a client sends it.
        raise EndpointError(
            f"endpoint {endpoint!r} is an abstract socket, which keeps no other user out: "
            "use ipc:///path/to/socket"
        )
    if transport == "tcp":
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise EndpointError(f"endpoint {endpoint!r} needs a host and a port from 1 to 65535 (tcp://host:port)")
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


_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class EndpointLock:
    """An exclusive lock on an endpoint, held while the daemon serves it (rule 4)."""

    # A client asking "is a daemon there?" (`endpoint_locked`) holds the lock
    # for microseconds; a daemon holds it for good. So a held lock is tried
    # again for this long before it means another daemon: a model server
    # polling a daemon that is starting had made it refuse to start ("already
    # serving", exit 4; 1 start in ~30 of a test that pings meanwhile).
    GRACE_S = 0.5

    def __init__(self, endpoint: str, *, clock=time.monotonic, wait=time.sleep):
        self.endpoint = endpoint
        self.path = ipc_path(endpoint)
        self._fd: int | None = None
        self._clock, self._wait = clock, wait

    def _lock(self, fd: int) -> None:
        """flock `fd` exclusively, trying again while a prober may hold it."""
        deadline = self._clock() + self.GRACE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in _HELD or self._clock() >= deadline:
                    raise
            self._wait(0.005)

    def acquire(self) -> None:
        """Check the endpoint, prepare the socket directory and take the lock.

        Raises EndpointError for an endpoint kvd cannot use, EndpointBusy if
        another daemon holds it.
        """
        check_endpoint(self.endpoint)
        if self.path is None:
            return
        run_dir = self.path.parent
        if is_default_run_dir(run_dir):
            # Check before and after: never create inside a squatted path,
            # and never trust a directory someone made first (rule 5).
            check_run_dir(run_dir)
            run_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                run_dir.mkdir(mode=0o700)
            except FileExistsError:
                pass
            check_run_dir(run_dir)
        else:
            run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_path = _lock_path(self.path)
        fd = _open_lock(lock_path, os.O_RDWR | os.O_CREAT)
        if fd is None:
            raise UnsafeEndpoint(f"refusing the kvd lock file {lock_path}: it is not a regular file of ours")
        try:
            self._lock(fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in _HELD:
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
    if is_default_run_dir(path.parent):
        check_run_dir(path.parent)
    try:
        fd = _open_lock(_lock_path(path), os.O_RDONLY)
    except FileNotFoundError:
        return False
    if fd is None:
        return None  # not a lock of ours: nothing it says can be believed
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


# macOS: struct xucred and the socket option, quoted verbatim (tabs expanded) from
# Apple's xnu, the source of the SDK's headers: apple-oss-distributions/xnu, tag
# xnu-11417.101.15, commit e3723e1f17661b24996789d8afc084c0c3303b26 (the same text at
# xnu-10002.1.13). tests/host/test_recorded_macos.py parses it and checks XUCRED_SIZE,
# the option numbers peer_uid passes and the parse against it.
#   bsd/sys/ucred.h, lines 203-209:
#     struct xucred {
#             u_int   cr_version;             /* structure layout version */
#             uid_t   cr_uid;                 /* effective user id */
#             short   cr_ngroups;             /* number of advisory groups */
#             gid_t   cr_groups[NGROUPS];     /* advisory group list */
#     };
#     #define XUCRED_VERSION  0
#   bsd/sys/param.h, line 100; bsd/sys/syslimits.h, line 104:
#     #define NGROUPS         NGROUPS_MAX     /* max number groups */
#     #define NGROUPS_MAX                16   /* max supplemental group id's */
#   bsd/sys/un.h, lines 84-88:
#     /* Level number of get/setsockopt for local domain sockets */
#     #define SOL_LOCAL               0
#
#     /* Socket options. */
#     #define LOCAL_PEERCRED          0x001           /* retrieve peer credentials */
XUCRED_SIZE = 76  # 4 + 4 + 2 (+2 padding) + 16 * 4


def xucred_uid(raw: bytes) -> int | None:
    """cr_uid of a struct xucred as LOCAL_PEERCRED returns it (pure: tested
    against recorded bytes), None for another layout version or short bytes."""
    import struct

    try:
        version, uid = struct.unpack_from("=2I", raw)
    except struct.error:
        return None
    return uid if version == 0 else None


def peer_uid(fd: int) -> int | None:
    """The uid of the process at the other end of the unix-socket connection
    `fd`; None if it cannot be told (not a unix socket, closed, another OS).
    The one OS-specific call here: Linux SO_PEERCRED, macOS LOCAL_PEERCRED."""
    import socket
    import struct

    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if s.family != socket.AF_UNIX:
            return None
        if sys.platform == "linux":  # struct ucred {pid, uid, gid}
            return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if sys.platform == "darwin":  # SOL_LOCAL (0), LOCAL_PEERCRED (1)
            return xucred_uid(s.getsockopt(0, 1, XUCRED_SIZE))
        return None
    except (OSError, struct.error):
        return None
    finally:
        s.detach()  # libzmq owns the fd


def _open_lock(path: Path, flags: int) -> int | None:
    """An fd of the lock file at `path`, or None if it is not a regular file
    of ours: in a shared directory another user may have put a FIFO there
    (an open would block for good; O_NONBLOCK stops that) or a file of theirs.
    Raises OSError (FileNotFoundError without O_CREAT)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EISDIR):  # a symlink or a folder under its name: not ours to use
            return None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        return None
    return fd


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its st_mode ("a FIFO",
    "a folder", ...): for the one line that refuses it."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "a special file"


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None


# -- CURVE keys for tcp endpoints (rule 6) --------------------------------------
#
# 6. A tcp:// endpoint is served only with ZeroMQ CURVE: the daemon's key pair
#    and the public keys of the clients it admits are files in a 0700 keys
#    directory (`kvd keys`), secrets of mode 0600, checked like run dirs (rule
#    5) before use. Without a server key pair the daemon refuses tcp unless
#    the operator sets allow_insecure_tcp. Layout of the keys directory:
#      server.key_secret       the daemon's pair       server.key    its public key
#      authorized/NAME.key     client public keys the daemon admits
#      clients/NAME.key_secret client pairs `kvd keys add-client` made for this user
#    The files use ZeroMQ's certificate format (zmq.auth.load_certificate).

SERVER_CERT = "server"
AUTHORIZED_DIR = "authorized"
CLIENTS_DIR = "clients"


class CurveKeys:
    """The key material of one side: its own pair, and (clients) the server's public key."""

    def __init__(self, public: bytes, secret: bytes, server: bytes | None = None):
        self.public, self.secret, self.server = public, secret, server


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def default_keys_dir(environ: dict[str, str] | None = None) -> Path:
    """`<config dir>/keys`: ~/.config/kvd/keys ($XDG_CONFIG_HOME), macOS
    ~/Library/Application Support/kvd/keys (the config file's folder)."""
    return config_dir(environ) / "keys"


def check_key_file(path: Path) -> None:
    """Raise UnsafeEndpoint unless `path` is a regular file of ours, mode 0600 or stricter."""
    _check_ours(path, "the key file", lambda mode: None if stat.S_ISREG(mode) else "is not a regular file",
                "other users may read it (chmod 600 it)", missing_ok=False)


def read_cert(path: Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate file, checked first."""
    import zmq.auth

    check_key_file(path)
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError) as err:  # garbage, a line without "="
        raise UnsafeEndpoint(f"{path} is not a ZeroMQ certificate ({type(err).__name__}: {err})") from None
    if not all(k is None or (isinstance(k, bytes) and len(k) == 40) for k in (public, secret)) or public is None:
        raise UnsafeEndpoint(f"{path} is not a ZeroMQ certificate (a key is not 40 Z85 characters)")
    return public, secret


def write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    """Write a certificate file of mode 0600 (created so; never chmod-ed after)."""
    lines = ["#   ZeroMQ CURVE certificate written by `kvd keys`", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def ensure_keys_dir(keys_dir: Path) -> Path:
    """Create the keys dir and its subfolders 0700, refusing one that is not private."""
    for d in (keys_dir, keys_dir / AUTHORIZED_DIR, keys_dir / CLIENTS_DIR):
        check_run_dir(d)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_run_dir(d)
    return keys_dir


def server_keys(keys_dir: Path) -> CurveKeys | None:
    """The daemon's pair, or None if `kvd keys init` was never run."""
    path = keys_dir / f"{SERVER_CERT}.key_secret"
    if not os.path.lexists(path):
        return None
    check_run_dir(keys_dir)
    public, secret = read_cert(path)
    if secret is None:
        raise UnsafeEndpoint(f"the key file {path} holds no secret key")
    return CurveKeys(public, secret)


def authorized_dir(keys_dir: Path) -> Path:
    path = keys_dir / AUTHORIZED_DIR
    check_run_dir(path)
    for entry in path.glob("*.key"):
        check_key_file(entry)
    return path


def client_keys(keys_dir: Path, name: str) -> CurveKeys | None:
    """A client's pair `name` and the server's public key, or None if either is missing."""
    pair, server = keys_dir / CLIENTS_DIR / f"{name}.key_secret", keys_dir / f"{SERVER_CERT}.key"
    if not (os.path.lexists(pair) and os.path.lexists(server)):
        return None
    public, secret = read_cert(pair)
    server_public, _ = read_cert(server)
    if secret is None:
        raise UnsafeEndpoint(f"the key file {pair} holds no secret key")
    return CurveKeys(public, secret, server_public)


REMOTE_KEY_FILE = "remote.key"  # in the keys dir, unless `remote_key_file` names another file


def remote_key_path(remote_key_file: str | None, keys_dir: str | None) -> Path:
    """The remote tier's key file: `remote_key_file`, else remote.key in the keys dir."""
    if remote_key_file:
        return Path(remote_key_file)
    return (Path(keys_dir) if keys_dir else default_keys_dir()) / REMOTE_KEY_FILE


def read_remote_key(path: Path):
    """The shared secret of the remote tier (kvd.protocol.remote_value.RemoteKey)
    from `path`, checked like every key file (ours, regular, 0600). Raises
    UnsafeEndpoint for a missing, unsafe or malformed file, naming the command
    that makes one."""
    from kvd.protocol.remote_value import RemoteKey

    if not os.path.lexists(path):
        raise UnsafeEndpoint(f"remote_url needs the remote tier's key file {path}: "
                             f"make it with `kvd keys remote` (then copy it to every daemon sharing the tier)")
    check_key_file(path)
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return RemoteKey.from_text(f.read(200))
    except ValueError as exc:
        raise UnsafeEndpoint(f"refusing the key file {path}: {exc}") from None


def write_remote_key(path: Path) -> str:
    """Write a fresh remote key (32 random bytes as 64 hex digits) to `path`,
    created 0600 and never overwriting; returns its fingerprint."""
    from kvd.protocol.remote_value import SECRET_BYTES, RemoteKey

    secret = os.urandom(SECRET_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return RemoteKey(secret).fingerprint
