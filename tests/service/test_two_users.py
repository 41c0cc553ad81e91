"""Two real OS users on one machine: B must never reach, squat or read A's kvd.

Run as root only (it creates two throwaway users with `useradd` and runs
processes as them with `setpriv`); skipped with the reason otherwise. Every
scenario is repeated under the umasks 000, 002, 022 and 077 the users' shells
might have: none of the protection may depend on it (kvd.endpoint rule 5).

The users run the venv's packages on the system python of the same minor
version: the venv's interpreter is a symlink into root's pyenv (/root is
0700, so other users cannot execute it), while the venv's site-packages and
the source tree are world-readable. Nothing in the repository is chmod-ed.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from kvd.cli import exits

from support import REPO

SYSTEM_PY = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
SITE = Path(sysconfig.get_paths()["purelib"])
UMASKS = ["000", "002", "022", "077"]

# Loads the venv's packages (and the editable kvd) into the system python.
_BOOT = "import runpy, site, sys; site.addsitedir(sys.argv.pop(1)); "


def _world_usable(path: Path) -> bool:
    """Every directory from / to `path` is searchable, and `path` readable, by others."""
    for p in [*reversed(path.parents), path]:
        mode = os.stat(p).st_mode
        if not mode & stat.S_IXOTH or (p == path and not mode & stat.S_IROTH):
            return False
    return True


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: creates two OS users (useradd) and runs processes as them (setpriv)"
    if not sys.platform.startswith("linux"):
        return "uses useradd and setpriv (Linux)"
    if not (shutil.which("useradd") and shutil.which("setpriv")):
        return "useradd or setpriv is missing"
    if not SYSTEM_PY.exists():
        return f"other users need a python they may run; {SYSTEM_PY} is missing"
    for p in (SITE, REPO / "kvd", REPO / "client"):
        if not _world_usable(p):
            return f"{p} is not readable by other users"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


class User:
    def __init__(self, name: str, home: Path):
        self.name, self.home = name, home
        pw = pwd.getpwnam(name)
        self.uid, self.gid = pw.pw_uid, pw.pw_gid

    def env(self, **extra: str) -> dict[str, str]:
        """A login-like environment: HOME, PATH, nothing of ours (no XDG_* dirs)."""
        return {"HOME": str(self.home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **extra}

    def argv(self, umask: str, *args: str) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--",
                "sh", "-c", f'umask {umask} && exec "$@"', "sh", *args]

    def python(self, umask: str, code: str, **env: str) -> subprocess.CompletedProcess:
        """Run `code` as this user; its last stdout line is parsed as JSON by callers."""
        return subprocess.run(self.argv(umask, str(SYSTEM_PY), "-I", "-S", "-c", _BOOT + code, str(SITE)),
                              env=self.env(**env), capture_output=True, text=True, timeout=120)

    def kvd(self, umask: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        code = "sys.argv = ['kvd', *sys.argv[1:]]; runpy.run_module('kvd', run_name='__main__')"
        return subprocess.run(self.argv(umask, str(SYSTEM_PY), "-I", "-S", "-c", _BOOT + code, str(SITE), *args),
                              env=self.env(**env), capture_output=True, text=True, timeout=120)

    def serve(self, umask: str, *args: str, log: Path, **env: str) -> subprocess.Popen:
        code = "sys.argv = ['kvd', *sys.argv[1:]]; runpy.run_module('kvd', run_name='__main__')"
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.argv(umask, str(SYSTEM_PY), "-I", "-S", "-c", _BOOT + code, str(SITE), "serve", "--ram-mb", "64", *args),
                env=self.env(**env), stdout=out, stderr=subprocess.STDOUT,
            )


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def users():
    """Two fresh users, A and B, with homes (0755, like most) under a 0755 temp dir."""
    base = Path(tempfile.mkdtemp(prefix="kvd-2u-", dir="/tmp"))
    base.chmod(0o755)
    made: list[str] = []
    try:
        out = []
        for tag in ("a", "b"):
            name = f"kvdtest-{secrets.token_hex(3)}{tag}"
            subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
            made.append(name)
            home = base / tag
            home.mkdir(mode=0o755)
            u = User(name, home)
            os.chown(home, u.uid, u.gid)
            out.append(u)
        yield base, out[0], out[1]
    finally:
        for name in made:
            try:
                uid = pwd.getpwnam(name).pw_uid
            except KeyError:
                continue
            shutil.rmtree(f"/tmp/kvd-{uid}", ignore_errors=True)
            if os.path.islink(f"/tmp/kvd-{uid}"):
                os.unlink(f"/tmp/kvd-{uid}")
            subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def daemons():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait_socket(path: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert proc.poll() is None, f"daemon exited {proc.returncode}: {log.read_text(errors='replace')}"
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.05)


def _fresh(path: Path) -> None:
    """Remove what a previous umask's run left (root may)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


ROUND_TRIP = """
import json, numpy as np
from kvd_client import Client
from kvd_client._tensors import HostTensor, Snapshot
s = np.arange(512)
snap = Snapshot({"k": (HostTensor.from_numpy(np.arange(512 * 4, dtype=np.float32).reshape(1, 512, 4)), 1)})
with Client(namespace="mine", strict=True) as c:
    ok = c.put(s, snap)
    hit = c.get(s)
    print(json.dumps({"endpoint": c.endpoint, "ok": ok, "n": hit.n,
                      "same": bool((hit.sliced["k"].array == snap.sliced["k"][0].array).all())}))
"""


@pytest.mark.parametrize("umask", UMASKS)
def test_other_user_cannot_reach_swap_or_read_the_default_daemon(users, daemons, umask):
    base, a, b = users
    run_dir = a.home / ".cache" / "kvd" / "run"
    sock, data = run_dir / "kvd.sock", a.home / ".cache" / "kvd"
    _fresh(a.home / ".cache")
    log = base / f"a-{umask}.log"
    daemons.append(proc := a.serve(umask, log=log))
    _wait_socket(sock, proc, log)

    # A's default client reaches A's daemon; everything it made is A's alone.
    got = _result(a.python(umask, ROUND_TRIP))
    assert got == {"endpoint": f"ipc://{sock}", "ok": True, "n": 512, "same": True}
    for path in (run_dir, data, data / "index"):
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == a.uid and stat.S_IMODE(st.st_mode) == 0o700, path
    assert os.lstat(sock).st_uid == a.uid

    # B: no connection, no swap, no pre-made file, no reading the data dir.
    probe = f"""
import json, os, socket
def attempt(f):
    try:
        f()
        return "allowed"
    except PermissionError:
        return "denied"
s = socket.socket(socket.AF_UNIX)
out = {{
    "connect": attempt(lambda: s.connect({str(sock)!r})),
    "list_run_dir": attempt(lambda: os.listdir({str(run_dir)!r})),
    "swap_socket": attempt(lambda: os.rename({str(sock)!r}, {str(sock)!r} + ".old")),
    "remove_socket": attempt(lambda: os.unlink({str(sock)!r})),
    "plant_file": attempt(lambda: open({str(run_dir / 'evil')!r}, "w")),
    "list_data_dir": attempt(lambda: os.listdir({str(data)!r})),
    "read_index": attempt(lambda: open({str(data / 'index' / 'data.mdb')!r}, "rb").read(1)),
}}
from kvd_client import Client
with Client("ipc://{sock}", namespace="mine", timeout=1) as c:
    out["get"] = c.get(list(range(512))) is None
    out["unsafe"] = c.counters["error_unsafe_endpoint"]
print(json.dumps(out))
"""
    got = _result(b.python(umask, probe))
    assert got == {
        "connect": "denied", "list_run_dir": "denied", "swap_socket": "denied", "remove_socket": "denied",
        "plant_file": "denied", "list_data_dir": "denied", "read_index": "denied", "get": True, "unsafe": 1,
    }
    # B cannot take the endpoint over either, and A's daemon serves on.
    r = b.kvd(umask, "serve", "--endpoint", f"ipc://{sock}", "--data-dir", str(b.home / "data"))
    assert r.returncode != 0
    assert proc.poll() is None
    got = _result(a.python(umask, ROUND_TRIP))
    assert got["ok"] and got["same"]


A_STRICT = """
import json, logging, numpy as np
from kvd.endpoint import default_endpoint
from kvd_client import Client, UnsafeEndpoint
from kvd_client._tensors import HostTensor, Snapshot
warnings = []
class Catch(logging.Handler):
    def emit(self, record): warnings.append(record.getMessage())
logging.getLogger("kvd_client").addHandler(Catch())
s = np.arange(512)
snap = Snapshot({"k": (HostTensor.from_numpy(np.zeros((1, 512, 4), np.float32)), 1)})
with Client(ENDPOINT, namespace="mine", timeout=1) as c:
    put, got, n = c.put(s, snap), c.get(s), c.probe(s).n
    counters = dict(c.counters)
try:
    Client(ENDPOINT, namespace="mine", strict=True).ping()
    strict = None
except UnsafeEndpoint as err:
    strict = str(err)
print(json.dumps({"default": default_endpoint(), "put": put, "get": got is None, "probe": n, "warnings": warnings,
                  "unsafe": counters.get("error_unsafe_endpoint", 0), "strict": strict}))
"""


def _a_refuses(a: User, umask: str, endpoint: str | None, **env: str) -> dict:
    return _result(a.python(umask, A_STRICT.replace("ENDPOINT", repr(endpoint)), **env))


def _requests(b: User, umask: str, endpoint: str) -> dict:
    code = f"""
import json
from kvd_client import Client
with Client({endpoint!r}, namespace="x", strict=True) as c:
    print(json.dumps(c.stats()["server"]["requests"]))
"""
    return _result(b.python(umask, code))


@pytest.mark.parametrize("umask", UMASKS)
def test_a_squatted_tmp_run_dir_is_refused_by_client_daemon_and_cli(users, daemons, umask):
    base, a, b = users
    # A home so deep that the cache run dir does not fit in sun_path: A's
    # default falls back to /tmp/kvd-<uid>, which B can try to create first.
    deep = str(a.home / ("d" * 100))
    env = {"XDG_CACHE_HOME": deep}
    squat = Path(f"/tmp/kvd-{a.uid}")
    _fresh(squat)
    sock = squat / "kvd.sock"
    r = b.python(umask, f"import os; os.mkdir({str(squat)!r}); os.chmod({str(squat)!r}, 0o777); print(1)")
    assert r.returncode == 0, r.stderr
    log = base / f"b-{umask}.log"
    daemons.append(proc := b.serve(umask, "--endpoint", f"ipc://{sock}", "--data-dir", str(b.home / f"d{umask}"), log=log))
    _wait_socket(sock, proc, log)

    got = _a_refuses(a, umask, None, **env)
    why = f"refusing the kvd run directory {squat}: it is owned by uid {b.uid}, not by you (uid {a.uid})"
    assert got["default"] == f"ipc://{sock}"
    assert got["put"] is False and got["get"] is True and got["probe"] == 0
    assert got["unsafe"] == 3 and got["strict"] == why
    assert len(got["warnings"]) == 1 and why in got["warnings"][0]
    # Not one message of A's reached B's daemon (B's own STATS is the only request).
    assert _requests(b, umask, f"ipc://{sock}") == {"STATS": 1}

    # A's daemon and A's commands refuse it too, in one line with the path.
    r = a.kvd(umask, "serve", **env)
    assert r.returncode == exits.CONFIG, r.stderr
    assert why in r.stderr
    for cmd in (["stats"], ["stop"]):
        r = a.kvd(umask, *cmd, **env)
        assert (r.returncode, r.stderr) == (exits.CONFIG, f"kvd: {why}\n"), cmd

    # The same directory as a symlink to one of B's is refused as such.
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(squat)
    target = b.home / f"t{umask}"
    r = b.python(umask, f"import os; os.mkdir({str(target)!r}, 0o700); os.symlink({str(target)!r}, {str(squat)!r}); print(1)")
    assert r.returncode == 0, r.stderr
    got = _a_refuses(a, umask, None, **env)
    assert got["strict"] == f"refusing the kvd run directory {squat}: it is a symbolic link, not a directory"
    r = a.kvd(umask, "serve", **env)
    assert r.returncode == exits.CONFIG and "symbolic link" in r.stderr
    assert not (target / "kvd.sock").exists()


@pytest.mark.parametrize("umask", UMASKS)
def test_a_refuses_a_socket_owned_by_b_in_a_shared_dir(users, daemons, umask):
    base, a, b = users
    shared = base / f"shared{umask}"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    sock = shared / "kvd.sock"
    log = base / f"bs-{umask}.log"
    daemons.append(proc := b.serve(umask, "--endpoint", f"ipc://{sock}", "--data-dir", str(b.home / f"s{umask}"), log=log))
    _wait_socket(sock, proc, log)
    got = _a_refuses(a, umask, f"ipc://{sock}")
    assert got["strict"] == f"refusing the kvd socket {sock}: it is owned by uid {b.uid}, not by you (uid {a.uid})"
    assert got["put"] is False and got["get"] is True and got["unsafe"] == 3
    assert _requests(b, umask, f"ipc://{sock}") == {"STATS": 1}


SHM_PEEK = """
import json, os, zmq
from kvd.protocol import codec
out = {}
s = zmq.Context.instance().socket(zmq.DEALER)
s.connect(ENDPOINT)
def ask(mtype, fields):
    s.send_multipart(codec.encode(mtype, fields, id=1))
    assert s.poll(5000)
    return codec.decode_reply(s.recv_multipart())
hello = ask("HELLO", {"versions": [1]})
folder = hello["shm"]["dir"]
out["offered"] = "shm" in hello["features"]
for what, fn in (("nonce", lambda: open(os.path.join(folder, "nonce"), "rb").read()),
                 ("list", lambda: os.listdir(folder)),
                 ("segment", lambda: open(os.path.join(folder, "kvd-%s-0" % hello["shm"]["run"]), "r+b"))):
    try:
        fn()
        out[what] = "read"
    except PermissionError:
        out[what] = "denied"
seq = {"ns": "a", "tokens": bytes(range(4)) * 300, "chunk_tokens": 256}
for proof in (b"\\0" * 32, b"guess" * 8):
    get = ask("GET", {**seq, "shm": {"proof": proof}})
    out.setdefault("get", []).append([get["n"], "shm" in get.fields,
        any(isinstance(t.data, codec.Descriptor) for c in get["chunks"] for t in c["tensors"])])
slots = ask("SLOTS", {**seq, "chunks": [{"index": 0, "tensors": []}], "shm": {"proof": b"\\0" * 32}})
out["slots"] = slots["name"]
print(json.dumps(out))
"""


@pytest.mark.parametrize("umask", ["000", "077"])
def test_other_user_is_never_given_a_shared_memory_segment(users, daemons, umask):
    """Even with A's socket opened to everyone, B sees only frames: it cannot
    read the nonce that proves same user, nor list or open A's segments."""
    base, a, b = users
    shared = base / f"shm{umask}"
    shared.mkdir()
    shared.chmod(0o1777)
    sock = shared / "kvd.sock"
    log = base / f"shm-{umask}.log"
    daemons.append(proc := a.serve(umask, "--endpoint", f"ipc://{sock}", "--data-dir", "none", log=log))
    _wait_socket(sock, proc, log)
    code = ("import numpy as np; from kvd_client import Client; from kvd_client._tensors import HostTensor, Snapshot\n"
            f"c = Client('ipc://{sock}', namespace='a', strict=True, chunk_tokens=256)\n"
            "t = np.frombuffer(bytes(range(4)) * 300, '<u4')\n"
            "snap = Snapshot({'k': (HostTensor.from_numpy(np.ones((1, 300, 4), np.float32)), 1)})\n"
            "assert c.put(t, snap) and c.counters['shm_puts'] == 1\n"
            "print(1)")
    r = a.python(umask, code)
    assert r.returncode == 0, r.stderr
    from kvd.server.shm.folders import plane_dirs

    [folder] = plane_dirs(sock, uid=a.uid)
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700 and os.lstat(folder).st_uid == a.uid
    sock.chmod(0o666)  # A's operator opens the socket to other users: still no segment for B
    got = _result(b.python(umask, f"ENDPOINT = 'ipc://{sock}'\n" + SHM_PEEK))
    assert got["offered"] is True
    assert (got["nonce"], got["list"], got["segment"]) == ("denied", "denied", "denied")
    assert got["get"] == [[300, False, False], [300, False, False]]  # served, over frames only
    assert got["slots"] == "BAD_FIELD"


SHM_PUT = """
import json, numpy as np
from kvd_client import Client
from kvd_client._tensors import HostTensor, Snapshot
c = Client(ENDPOINT, namespace="a", strict=True, chunk_tokens=256)
t = np.arange(300)
snap = Snapshot({"k": (HostTensor.from_numpy(np.ones((1, 300, 4), np.float32)), 1)})
ok = c.put(t, snap)
print(json.dumps({"ok": ok, "shm_puts": c.counters["shm_puts"], "dir": c.stats()["shm"]["dir"]}))
"""


def test_other_user_cannot_take_the_shared_memory_folder_first(users, daemons):
    """B makes the names A's plane folder could have first: the fixed one
    daemons before 0.2 used and one of the new pattern. A's daemon still
    gets shared memory, in a folder it made; a restart after A's daemon is
    killed sweeps A's old folder and never B's."""
    from kvd.server.shm.folders import plane_dirs, plane_prefix

    base, a, b = users
    shared = base / "shmsquat"
    shared.mkdir()
    shared.chmod(0o1777)
    sock = shared / "kvd.sock"
    prefix = plane_prefix(sock, uid=a.uid)
    squats = [prefix, prefix.with_name(prefix.name + "-" + "0" * 16)]
    for path in squats:
        r = subprocess.run(b.argv("022", "mkdir", "-m", "700", str(path)), env=b.env(), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    log = base / "shmsquat.log"
    try:
        folders = []
        for _ in range(2):
            sock.unlink(missing_ok=True)  # the killed daemon's socket would look like readiness
            daemons.append(proc := a.serve("022", "--endpoint", f"ipc://{sock}", "--data-dir", "none", log=log))
            _wait_socket(sock, proc, log)
            got = _result(a.python("022", f"ENDPOINT = 'ipc://{sock}'\n" + SHM_PUT))
            assert got["ok"] and got["shm_puts"] == 1, log.read_text(errors="replace")
            folder = Path(got["dir"])
            assert folder not in squats and os.lstat(folder).st_uid == a.uid
            folders.append(folder)
            proc.kill()
            proc.wait()
        assert folders[0] != folders[1]
        assert plane_dirs(sock, uid=a.uid) == [folders[1]]  # the first run's swept by the second's start
        assert all(os.lstat(p).st_uid == b.uid for p in squats)  # B's names untouched
    finally:
        for path in [*squats, *plane_dirs(sock, uid=a.uid)]:
            shutil.rmtree(path, ignore_errors=True)


SWAP_A = """
import json, os, time, numpy as np
from kvd_client import Client
from kvd_client._tensors import HostTensor, Snapshot
s = np.arange(512)
snap = Snapshot({"k": (HostTensor.from_numpy(np.arange(512 * 4, dtype=np.float32).reshape(1, 512, 4)), 1)})
out = []
c = Client(ENDPOINT, namespace="mine", strict=True, timeout=1)
for step in ("before", "after"):
    # After B moved: the client's breaker may still be backing off from the
    # first miss (DaemonUnavailable without trying): ask until it tries.
    until = time.monotonic() + (20 if step == "after" else 0)
    while True:
        try:
            out.append(["ok", c.put(s, snap)])
        except Exception as e:
            if type(e).__name__ == "DaemonUnavailable" and time.monotonic() < until:
                time.sleep(0.05)
                continue
            out.append([type(e).__name__, str(e)])
        break
    if step == "before":  # no daemon yet; ZeroMQ goes on reconnecting in the background
        open(FLAGS + "/a-waiting", "w").close()
        deadline = time.monotonic() + 30
        while not os.path.exists(FLAGS + "/b-moved") and time.monotonic() < deadline:
            time.sleep(0.02)
print(json.dumps(out))
"""

SWAP_B = """
import os, socket, sys, threading, time
path, flags, mine = sys.argv[1], sys.argv[2], sys.argv[3]
deadline = time.monotonic() + 30
while not os.path.exists(flags + "/a-waiting") and time.monotonic() < deadline:
    time.sleep(0.02)
ls = socket.socket(socket.AF_UNIX)
ls.bind(path)
os.chmod(path, 0o777)
ls.listen(8)
ls.settimeout(20)
conn, _ = ls.accept()  # A's background reconnect
os.unlink(path)  # gone from the path; the connection stays
up = socket.socket(socket.AF_UNIX)
up.connect(mine)  # relayed to B's own daemon, which answers as kvd does
open(flags + "/b-moved", "w").close()
got = [0]
def pump(src, dst, count):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            if count:
                got[0] += len(data)
            dst.sendall(data)
    except OSError:
        pass
threading.Thread(target=pump, args=(up, conn, False), daemon=True).start()
conn.settimeout(5)
pump(conn, up, True)
print(got[0])
"""


def test_a_connection_to_a_socket_another_user_served_is_refused(users, daemons):
    """B serves A's endpoint path for a moment: A's client, reconnecting in
    the background, connects; B removes the path, so the file checks pass at
    A's next request. The connection's peer is checked too: A refuses it
    and sends nothing (a red-team pass had A's puts land in B's daemon)."""
    base, a, b = users
    shared = base / "swap"
    shared.mkdir()
    shared.chmod(0o1777)
    sock, mine, log = shared / "kvd.sock", b.home / "swap.sock", base / "swap-b.log"
    daemons.append(proc := b.serve("077", "--endpoint", f"ipc://{mine}", "--data-dir", "none", log=log))
    _wait_socket(mine, proc, log)
    attacker = subprocess.Popen(b.argv("077", str(SYSTEM_PY), "-I", "-S", "-c", SWAP_B, str(sock), str(shared), str(mine)),
                                env=b.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    daemons.append(attacker)
    got = _result(a.python("077", f"ENDPOINT = 'ipc://{sock}'\nFLAGS = '{shared}'\n" + SWAP_A))
    out, err = attacker.communicate(timeout=60)
    assert attacker.returncode == 0, err
    assert got[0][0] == "DaemonUnavailable"
    assert got[1][0] == "UnsafeEndpoint" and f"runs as uid {b.uid}" in got[1][1], got
    assert int(out.strip()) < 1024  # ZeroMQ's greeting and handshake only: no request (a put is ~12 KiB)
    assert _requests(b, "077", f"ipc://{mine}") == {"STATS": 1}  # B's daemon saw nothing of A's
