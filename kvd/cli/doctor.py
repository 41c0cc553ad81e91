"""`kvd doctor`: what kvd will use on this machine, and what is wrong with it.

One line per check: `ok`, `warn` (kvd works, worse than it could) or `fail`
(something here would stop kvd from working), what was found, and in
brackets the mechanism kvd uses for it. Rules the checks keep:

1. A line says only what its check did: a segment "written and read back"
   was written and read back, a daemon "answers" answered a ping. What was
   not tried says "not tested" and why.
2. Doctor runs the daemon's own code for each OS-specific step (through
   kvd.cli.doctor_host, the one module that imports it), so what it reports
   is what `kvd serve` would meet.
3. mlx, mlx-lm and the adapters are imported in a child process, never in
   this one: a missing or broken mlx is a line, not a crash, and the layers
   keep their rule that only the adapters import mlx.
4. A check that itself breaks is a `warn` saying it could not check (never a
   `fail`: that would claim kvd cannot work when only doctor could not tell).

Exit status: 0 with only ok and warn lines; 1 (exits.FAILED) if any check
failed; 78 for bad configuration, as every command.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import click

from kvd.cli import exits, main
from kvd.cli.common import printable, settings, size
from kvd.config import config_options
from kvd.host.select import mechanism as host_mechanism
from kvd.host.select import mechanisms as host_mechanisms
from kvd.host.select import use as select_host

OK, WARN, FAIL = "ok", "warn", "fail"
_FD_WARN = 1024  # under this kvd serve runs, with a small peer cap
_PING_S = 1.0  # the longest doctor waits for a daemon's answer
_PROBE_S = 120.0  # importing mlx, mlx-lm and vllm-mlx on a busy machine


@dataclass
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str
    mechanism: str = ""

    def line(self) -> str:
        how = f"  [{self.mechanism}]" if self.mechanism else ""
        return printable(f"{self.status:<5} {self.name:<14} {self.detail}{how}")


# -- the child process that imports mlx ------------------------------------------------

# Run with `python -c`: each probe is caught on its own, and the whole answer
# is one JSON object on the last line of stdout (an import may print before it).
_PROBE = r"""
import importlib, json, sys
out = {}
try:
    mx = importlib.import_module("mlx.core")  # this child's import; kvd's own processes never load mlx
    out["mlx"] = {"version": getattr(mx, "__version__", "?"), "metal": bool(mx.metal.is_available()),
                  "device": str(mx.default_device())}
except BaseException as err:
    out["mlx"] = {"error": f"{type(err).__name__}: {err}"}
if "vllm" in sys.argv[1:]:
    try:
        a = importlib.import_module("kvd_client.vllm_mlx")
        out["vllm_mlx"] = {"missing": a.missing(), "tested": a.TESTED_VERSION}
    except BaseException as err:
        out["vllm_mlx"] = {"error": f"{type(err).__name__}: {err}"}
if "mlx_lm" in sys.argv[1:]:
    try:
        s = importlib.import_module("mlx_lm.server")
        out["mlx_lm"] = {"missing": [n for n in ("run", "LRUPromptCache") if not hasattr(s, n)]}
    except BaseException as err:
        out["mlx_lm"] = {"error": f"{type(err).__name__}: {err}"}
sys.stdout.write("\n" + json.dumps(out) + "\n")
"""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class _Probe:
    """The child process importing mlx (rule 3), started first so it runs
    while the other checks do; `result()` waits for its JSON answer."""

    def __init__(self):
        args = [a for a, dist in (("vllm", "vllm-mlx"), ("mlx_lm", "mlx-lm")) if _version(dist)]
        self._answer: dict | None = None
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, *args], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        except OSError as err:  # no fd, no memory, no process left
            self._answer = {"error": f"cannot start a child process: {err.strerror or err}"}

    def result(self) -> dict:
        if self._answer is None:
            try:
                out, err = self._proc.communicate(timeout=_PROBE_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.communicate()
                self._answer = {"error": f"importing mlx took over {_PROBE_S:.0f} s"}
                return self._answer
            try:
                self._answer = json.loads((out.strip().splitlines() or [""])[-1])
            except ValueError:
                last = (err.strip().splitlines() or [f"exit status {self._proc.returncode}"])[-1]
                self._answer = {"error": f"the probe process died: {last}"}
        return self._answer


# -- the checks --------------------------------------------------------------------------


def check_python(ctx) -> Check:
    v = sys.version_info
    status = OK if v >= (3, 11) else FAIL
    return Check("python", status, f"{platform.python_version()} ({sys.executable})"
                 + ("" if status == OK else ": kvd needs 3.11 or newer"))


def check_packages(ctx) -> Check:
    import lmdb
    import numpy
    import zmq

    from kvd import __version__

    found = [f"kvd {__version__}", f"pyzmq {zmq.pyzmq_version()} (libzmq {zmq.zmq_version()})",
             f"lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))})", f"numpy {numpy.__version__}"]
    return Check("packages", OK, ", ".join(found), "imported here")


def check_redis(ctx) -> Check:
    version, wanted = _version("redis"), ctx.cfg.remote_url is not None
    if version:
        return Check("redis", OK, f"redis-py {version}" + (", hiredis " + _version("hiredis") if _version("hiredis") else ""),
                     "package metadata (the remote tier imports it)")
    if wanted:
        return Check("redis", FAIL, "remote_url is set but redis-py is not installed (pip install 'kvd[remote]')")
    return Check("redis", OK, "not installed (needed only for remote_url)")


def check_mlx(ctx) -> Check:
    mlx, lm = _version("mlx"), _version("mlx-lm")
    versions = f"mlx {mlx or 'not installed'}, mlx-lm {lm or 'not installed'}"
    got = ctx.probe.result().get("mlx") or ctx.probe.result()
    if "error" in got:
        return Check("mlx", WARN, f"{versions}; cannot import mlx: {got['error']} "
                     "(the daemon does not need it; model servers do)", "imported in a child process")
    metal = "Metal available" if got["metal"] else "Metal not available"
    status = WARN if sys.platform == "darwin" and not got["metal"] else OK
    if lm is None:
        status = WARN
    return Check("mlx", status, f"{versions}; {metal}, default device {got['device']}",
                 "mx.metal.is_available() in a child process")


def check_endpoint(ctx) -> Check:
    h = ctx.host
    ep = ctx.cfg.endpoint
    try:
        h.check_endpoint(ep)
    except h.EndpointError as err:
        return Check("endpoint", FAIL, str(err))
    path = h.ipc_path(ep)
    if path is None:
        return Check("endpoint", OK, f"{ep} (tcp: no folder to check; shared memory is not offered)",
                     "kvd.endpoint rules 1-2")
    folder = path.parent
    try:
        h.check_socket(path)  # on every ipc endpoint
    except h.EndpointError as err:
        return Check("endpoint", FAIL, f"{ep}: {err}", "kvd.endpoint rule 5: clients refuse it")
    try:
        h.check_run_dir(folder)
    except h.EndpointError as err:
        if h.is_default_run_dir(folder):
            return Check("endpoint", FAIL, f"{ep}: {err}", "kvd.endpoint rule 5: the daemon and clients refuse it")
        # kvd.endpoint's words are a refusal; for a folder the operator chose
        # kvd does not refuse, so doctor says what is wrong without "refusing".
        fault = str(err).removeprefix("refusing ")
        return Check("endpoint", WARN, f"{ep}: {fault} (a folder you chose: kvd does not refuse it)",
                     "kvd.endpoint rule 5, enforced for the default folders only")
    if not folder.exists():
        return Check("endpoint", OK, f"{ep}: folder {folder} does not exist yet (the daemon makes it 0700)",
                     "kvd.endpoint rules 1-5")
    st = os.lstat(folder)
    return Check("endpoint", OK, f"{ep}: folder owned by uid {st.st_uid} (you), mode {st.st_mode & 0o7777:04o}",
                 "kvd.endpoint rules 1-5")


def check_daemon(ctx) -> Check:
    h = ctx.host
    ep = ctx.cfg.endpoint
    timeout = min(ctx.cfg.timeout, _PING_S)
    answered, why = ctx.answered = h.ping(ep, timeout, ctx.cfg.keys_dir, ctx.cfg.client_key)
    how = f"a kvd_client ping, {timeout:g} s timeout"
    if answered:
        return Check("daemon", OK, f"answers at {ep} ({why})", how)
    try:
        locked = h.endpoint_locked(ep)
    except h.EndpointError:
        locked = None
    if locked:
        return Check("daemon", WARN, f"a daemon holds {ep}'s lock but did not answer ({why}): busy, starting or stuck?", how)
    why = "" if ep in why else f" ({why})"  # the client's "no daemon at EP" says nothing more
    return Check("daemon", WARN, f"none answers at {ep}{why}; start one with `kvd serve` or `kvd service install`", how)


def check_host(ctx) -> Check:
    """The host seam's choice for each OS concern (kvd.host.select), as `kvd
    serve` with these settings would make it."""
    chosen = host_mechanisms()
    name = chosen.pop("host")
    return Check("host", OK, f"{name}: " + ", ".join(f"{concern} {how}" for concern, how in chosen.items()),
                 "kvd.host.select (the host setting, KVD_HOST)")


def check_fds(ctx) -> Check:
    fd = ctx.host.fd_limits()
    detail = (f"soft {_n(fd.soft)}, hard {_n(fd.hard)}; kvd serve raises the soft limit to {_n(fd.raised)}: "
              f"default max_peers {fd.max_peers}")
    how = (f"RLIMIT_NOFILE, raised at start as kvd serve does; open fds from {host_mechanism('open_fds')}; "
           f"accept: {host_mechanism('accept_guard')}")
    if fd.raised < _FD_WARN:
        return Check("fd limit", WARN, f"{detail} (under {_FD_WARN}: raise it, e.g. ulimit -n or LimitNOFILE=)", how)
    return Check("fd limit", OK, detail, how)


def _n(limit: int) -> str:
    import resource

    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def check_memory(ctx) -> Check:
    rss, tuned = ctx.host.memory_watch()
    malloc = "glibc malloc tuned (frames of 4 MiB and more mmapped)" if tuned else "malloc not tuned (no glibc)"
    if rss is None:
        return Check("memory", WARN, f"RSS cannot be read cheaply here: the daemon's memory watchdog is off; {malloc}",
                     "rss_bytes, mallopt")
    source = {"proc_pid_rusage": "proc_pid_rusage ri_phys_footprint", "statm": "/proc/self/statm"}.get(
        host_mechanism("process_memory"), host_mechanism("process_memory"))
    return Check("memory", OK, f"RSS readable (this process: {size(rss)}); {malloc}",
                 f"{source} for the peer gate's watchdog, mallopt")


def check_shm(ctx) -> Check:
    h = ctx.host
    path = h.ipc_path(ctx.cfg.endpoint)
    if not ctx.cfg.shm:
        return Check("shared memory", OK, "off (shm = false): data goes over ZeroMQ frames")
    if path is None:
        return Check("shared memory", OK, "not offered on a tcp endpoint: data goes over ZeroMQ frames")
    where = h.segment_folder(path)
    if not where.is_dir():
        return Check("shared memory", WARN, f"not tested: {where} does not exist yet (the daemon makes it at start)")
    try:
        trial = h.try_segment(path)
    except (OSError, AssertionError) as err:
        return Check("shared memory", FAIL, f"a segment in {where} failed: {err}; clients fall back to frames, "
                     "which are slower", "the daemon's Arena")
    fs = _fs_type(trial.folder.parent)
    done = (f"a {size(trial.nbytes)} segment in {trial.folder.parent}{f' ({fs})' if fs else ''}: made, written, "
            + ("handed over by fd, " if trial.handed else "") + "read back through a second mapping, removed")
    if trial.sealed:
        return Check("shared memory", OK, done + _pages(), "sealed memfd named by a symlink, mmap")
    if trial.mechanism == "shm_open":
        how = "POSIX shm_open object, unlinked at once, handed out by fd (SCM_RIGHTS)"
        if sys.platform.startswith("linux"):  # host = portable: unsealed, so the daemon reads them with pread
            how += " (host = portable), pread/pwrite in the daemon"
        return Check("shared memory", OK, done, how + ", mmap in clients")
    if sys.platform.startswith("linux"):
        why = "memfd_create or sealing refused here: segments are unsealed files 0600"
        if fs != "tmpfs":
            why += f" on {fs or 'a filesystem of unknown type'}, not tmpfs: their pages are written back to disk"
        return Check("shared memory", WARN, f"{done}; {why}", "file 0600, mmap")
    return Check("shared memory", OK, done, "file 0600 in a 0700 folder, mmap")


def _pages() -> str:
    """What pages a memfd segment gets, and where 2 MiB ones are one setting away."""
    pages = host_mechanism("shared_memory_pages")
    if pages.startswith("2 MiB"):
        return f"; {pages} pages"
    from kvd.host.segments import SHMEM_THP, shmem_huge_policy

    policy = shmem_huge_policy()
    if policy is None or policy == "deny":
        return f"; {pages} pages"
    return (f"; {pages} pages: Linux's shmem THP policy is {policy}. With `advise` in {SHMEM_THP} a fresh "
            "daemon prepares its pages and a new client first copies them up to several times faster (2 MiB pages; "
            "docs/shared-memory.md, Huge pages)")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _fs_type(path: Path) -> str | None:
    """The filesystem type of the mount holding `path` (Linux: /proc/mounts); None elsewhere."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for point, fs in mounts:
        point = point.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (best is None or len(point) >= len(best[0])):
            best = (point, fs)
    return best[1] if best else None


def check_data_dir(ctx) -> Check:
    d = ctx.cfg.data_dir
    if d is None:
        return Check("data dir", OK, "none: RAM only, no SSD tier")
    d = Path(d)
    at = _existing(d)
    st = os.statvfs(at)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    fs = _fs_type(at)
    where = f"{d}" + ("" if at == d else f" (not made yet; measured at {at}, its nearest existing parent)")
    detail = f"{where}: {size(free)} free of {size(total)}" + (f", {fs}" if fs else "")
    how = "statvfs" + (", /proc/mounts" if fs else "")
    min_free = int(ctx.cfg.min_free_gb * (1 << 30))
    if free < min_free:
        return Check("data dir", WARN, f"{detail}: under min_free_gb ({ctx.cfg.min_free_gb:g} GiB), "
                     "the SSD tier writes nothing", how)
    if fs == "tmpfs":
        return Check("data dir", WARN, f"{detail}: tmpfs is memory, the SSD tier would not outlive a reboot", how)
    return Check("data dir", OK, detail, how)


def check_fsync(ctx) -> Check:
    import fcntl

    d = ctx.cfg.data_dir
    if d is None:
        return Check("fsync", OK, "not used (no data dir)")
    at = _existing(Path(d))
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is None:
        how = "fsync (no F_FULLFSYNC here)"
    elif not ctx.cfg.full_fsync:
        # Blob files take fsync only unless full_fsync asks (kvd.store.ssd.blobfile);
        # the check still tries F_FULLFSYNC, to say whether asking would work.
        how = "fsync (F_FULLFSYNC only with full_fsync = true)"
    else:
        how = "F_FULLFSYNC, then fsync"
    data = os.urandom(64 << 10)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kvd-doctor-", dir=at)
    except OSError as err:
        return Check("fsync", FAIL, f"cannot create a file in {at}: {err.strerror or err} "
                     "(the daemon would serve from RAM only, degraded)", how)
    note = ""
    try:
        t0 = time.perf_counter()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if full is not None:
            try:
                fcntl.fcntl(fd, full)
            except OSError as err:
                note = f"; F_FULLFSYNC refused ({err.strerror}): fsync only, the drive's cache may not be flushed"
        os.fsync(fd)
        ms = (time.perf_counter() - t0) * 1000
        if os.pread(fd, len(data), 0) != data:
            return Check("fsync", FAIL, f"a file in {at} read back other bytes than were written", how)
    except OSError as err:
        return Check("fsync", FAIL, f"cannot write and sync a file in {at}: {err.strerror or err} "
                     "(the daemon would serve from RAM only, degraded)", how)
    finally:
        os.close(fd)
        os.unlink(tmp)
    return Check("fsync", WARN if note else OK, f"64 KiB written, synced and read back in {at}{'' if at == Path(d) else ' (the data dir is not made yet)'}"
                 f" in {ms:.1f} ms{note}", how)


def check_pressure(ctx) -> Check:
    spec = ctx.cfg.pressure_source
    sample = ctx.host.pressure_sample(spec)
    if sample is None:
        return Check("pressure", OK, "off: the RAM tier keeps its budget whatever the machine's memory")
    avail = f"; {size(sample.available)} available of {size(sample.total)}" if sample.available is not None else ""
    how = {"meminfo+psi+cgroup": "/proc/meminfo, PSI, cgroups", "meminfo+cgroup": "/proc/meminfo, cgroups (no PSI)",
           "sysctl+vm_stat": "sysctl kern.memorystatus_vm_pressure_level, vm_stat"}
    mech = f"file {spec[5:]}" if spec.startswith("file:") else how.get(host_mechanism("memory_pressure"), "none on " + sys.platform)
    status = OK if sample.level == "normal" else WARN
    return Check("pressure", status, f"{spec}: {sample.level} ({sample.reason}){avail}", mech)


def check_service(ctx) -> Check:
    try:
        st = ctx.host.service_state(ctx.cfg.endpoint, getattr(ctx, "answered", (False, "not pinged")))
    except ctx.host.UnsupportedPlatform as err:
        return Check("service", WARN, str(err))
    if not st.installed:
        return Check("service", OK, f"not installed ({st.path}); `kvd service install` runs kvd at login", st.init)
    return Check("service", OK if st.loaded else WARN, f"installed ({st.path}); {st.asked}; logs: {st.log}", st.init)


def check_vllm_mlx(ctx) -> Check:
    version = _version("vllm-mlx")
    if version is None:
        return Check("vllm-mlx", OK, "not installed (needed only for kvd-vllm-mlx)")
    got = ctx.probe.result().get("vllm_mlx") or ctx.probe.result()
    how = "kvd_client.vllm_mlx.missing() in a child process"
    if "error" in got:
        return Check("vllm-mlx", WARN, f"{version}; the adapter cannot be imported: {got['error']}", how)
    if got["missing"]:
        return Check("vllm-mlx", WARN, f"{version}: the adapter's check failed ({', '.join(got['missing'])}; "
                     f"tested with {got['tested']}): kvd-vllm-mlx would run it without kvd", how)
    return Check("vllm-mlx", OK, f"{version}: has everything the adapter needs (tested with {got['tested']})", how)


def check_mlx_lm_server(ctx) -> Check:
    version = _version("mlx-lm")
    if version is None:
        return Check("mlx-lm server", OK, "mlx-lm not installed (needed only for kvd-mlx-lm-server)")
    got = ctx.probe.result().get("mlx_lm") or ctx.probe.result()
    how = "mlx_lm.server imported in a child process"
    if "error" in got:
        return Check("mlx-lm server", WARN, f"mlx-lm {version}; mlx_lm.server cannot be imported: {got['error']}", how)
    if got["missing"]:
        return Check("mlx-lm server", WARN, f"mlx-lm {version}: mlx_lm.server lacks {', '.join(got['missing'])}, "
                     "which kvd-mlx-lm-server rebinds", how)
    return Check("mlx-lm server", OK, f"mlx-lm {version}: mlx_lm.server has run and LRUPromptCache, "
                 "which kvd-mlx-lm-server rebinds", how)


# In the order they print. The daemon's ping comes before the service, which reuses it.
CHECKS: list[tuple[str, Callable]] = [
    ("host", check_host), ("python", check_python), ("packages", check_packages), ("redis", check_redis), ("mlx", check_mlx),
    ("endpoint", check_endpoint), ("daemon", check_daemon), ("fd limit", check_fds), ("memory", check_memory),
    ("shared memory", check_shm), ("data dir", check_data_dir), ("fsync", check_fsync),
    ("pressure", check_pressure), ("service", check_service), ("vllm-mlx", check_vllm_mlx),
    ("mlx-lm server", check_mlx_lm_server),
]


class _Context:
    def __init__(self, cfg):
        from kvd.cli import doctor_host

        self.cfg, self.host = cfg, doctor_host
        self.probe = _Probe()


def run_checks(cfg) -> list[Check]:
    """Every check against the settings `cfg`, in order; a check that breaks is a warn (rule 4)."""
    ctx = _Context(cfg)
    done = []
    for name, check in CHECKS:
        try:
            done.append(check(ctx))
        except Exception as err:
            done.append(Check(name, WARN, f"could not check: {type(err).__name__}: {err}"))
    return done


@main.command()
@config_options(names=("endpoint", "timeout", "keys_dir", "client_key", "data_dir", "pressure_source", "shm", "min_free_gb", "remote_url"))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
def doctor(as_json: bool, **flags) -> None:
    """Check this machine: what kvd will use here, and what is wrong.

    One line per check -- ok, warn or fail -- with what was found and, in
    brackets, the mechanism kvd uses. Nothing is claimed that was not tried:
    the shared-memory segment is made, written, read back and removed, the
    fsync is done on a file in the data dir, the daemon is pinged.
    `--json` prints {"ok", "exit_code", "checks": [{name, status, detail,
    mechanism}]}. Exits 0 with only ok and warn lines, 1 if any check failed
    (something here would stop kvd from working), 78 for bad configuration.
    """
    cfg = settings(flags)
    select_host(cfg.host)  # the mechanisms kvd serve would use (kvd.host.select)
    checks = run_checks(cfg)
    failed = [c for c in checks if c.status == FAIL]
    code = exits.FAILED if failed else exits.OK
    if as_json:
        click.echo(json.dumps({"ok": not failed, "exit_code": code, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        for c in checks:
            click.echo(c.line())
        warned = sum(c.status == WARN for c in checks)
        click.echo(f"kvd doctor: {len(failed)} failed, {warned} warnings, {len(checks) - len(failed) - warned} ok")
    raise SystemExit(code)
