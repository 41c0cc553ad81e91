"""Shared fixtures: a real `kvd serve` process on a throwaway socket.

`kvd_daemon` starts one daemon per test; `daemon_factory` starts several or
with extra flags. Each daemon gets its own short socket directory under /tmp
(ipc paths are limited to ~104 bytes, and pytest's tmp_path can be longer)
and its own data dir. The daemon's log is printed if a test fails to start it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest


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


# The tests that reach an OS seam (kvd/host/select.py: shared memory, fds and
# the accept guard, process memory, pressure, peers, the doctor) run twice,
# as `test_x[auto]` and `test_x[portable]`: on this OS's host and on the
# portable host, the POSIX-only mechanisms macOS runs (the `kvd_host` fixture,
# which reaches the daemons the fixtures start and nothing else). They carry
# the `seam` mark:
# - in the files SEAMS lists, the tests that start a daemon (DAEMON_FIXTURES):
#   the others would run twice exactly alike; NAMED_HOST's files are left
#   out, their daemons name their host;
# - elsewhere, a test marked `seam` in its file (test_doctor.py).
# A test of a mechanism the portable host does not have is marked `auto_host`
# and skips there, with the reason. KVD_TEST_HOST=portable runs every test's
# daemons on the portable host instead, once.
DAEMON_FIXTURES = ("daemon_factory", "kvd_daemon")
SEAMS = (
    "server/test_shm_", "server/test_peers.py", "server/test_pressure.py", "server/test_hostile_host.py",
    "server/test_backlog_keeps.py", "client/test_mlx_daemon.py",
)
NAMED_HOST = ("server/test_shm_portable.py", "server/test_shm_handout.py")
HOSTS = ("auto", "portable")


def _where(path) -> str:
    return Path(str(path)).resolve().relative_to(Path(__file__).resolve().parent).as_posix()


def _is_seam(where: str, fixturenames, marked: bool) -> bool:
    return marked or (where.startswith(SEAMS) and not where.startswith(NAMED_HOST)
                      and any(f in fixturenames for f in DAEMON_FIXTURES))


def pytest_generate_tests(metafunc):
    if os.environ.get("KVD_TEST_HOST") or "kvd_host" not in metafunc.fixturenames:
        return
    marked = metafunc.definition.get_closest_marker("seam") is not None
    if _is_seam(_where(metafunc.definition.fspath), metafunc.fixturenames, marked):
        metafunc.parametrize("kvd_host", HOSTS, indirect=True)


# The files that take longest (15-56 s each on one worker, session 51, the
# seam files with both hosts' runs), run first: pytest-xdist's `--dist
# loadfile` hands files out in collection order (`./dev test` turns off its
# reordering by test count, which put the files of one or two long tests
# last), so a slow file collected last ran alone while the other worker
# waited, at the end of a run.
SLOW_FIRST = (
    "store/test_durability.py", "store/test_ssd_rows.py", "server/test_shm_daemon.py", "server/test_backlog_keeps.py",
    "client/test_mlx_daemon.py", "service/test_two_users.py", "adapters/test_vllm_scheduler.py",
    "server/test_pressure.py", "service/test_doctor.py", "store/test_heal.py", "store/test_remote_cluster.py",
    "adapters/test_server_http.py", "service/test_cli_hostile.py", "store/test_remote_tier.py", "server/test_lanes.py",
    "adapters/test_vllm_mllm.py", "server/test_daemon.py", "server/test_peers.py", "adapters/test_import_export.py",
    "server/test_shm_integrity.py", "server/test_shm_prepare.py", "server/test_backoff.py", "store/test_ssd_daemon.py",
    "server/test_frame_bombs.py", "client/test_client_faults.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {}
    for item in items:
        where = _where(item.fspath)
        if _is_seam(where, item.fixturenames, item.get_closest_marker("seam") is not None):
            item.add_marker(pytest.mark.seam)
        callspec = getattr(item, "callspec", None)
        host = (callspec.params.get("kvd_host") if callspec else None) or os.environ.get("KVD_TEST_HOST")
        if (auto_only := item.get_closest_marker("auto_host")) and host == "portable":
            item.add_marker(pytest.mark.skip(reason=auto_only.kwargs.get("reason", "this OS's host only")))
        rank[item.nodeid] = SLOW_FIRST.index(where) if where in SLOW_FIRST else len(SLOW_FIRST)
    items.sort(key=lambda item: rank[item.nodeid])  # (stable: a file's tests stay together, in order)


def pytest_unconfigure(config):
    shutil.rmtree(_SANDBOX, ignore_errors=True)


def _launcher():
    """bench/_util.py's DaemonProcess: the one daemon launcher of the benches,
    the examples and these fixtures (loaded by path: bench/ is no package)."""
    spec = importlib.util.spec_from_file_location("kvd_bench_util", Path(__file__).resolve().parent.parent / "bench" / "_util.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DaemonProcess


class DaemonProcess(_launcher()):
    """A `python -m kvd serve` child process and how to reach it (bench/_util.py):
    its clients are in namespace "test" unless a test names one; it runs on
    `host` ("portable": the POSIX-only mechanisms macOS runs, kvd/host/select.py),
    by default on what KVD_TEST_HOST names (KVD_* of the environment never
    reach a test's daemon otherwise), else on this OS's.

    Its shared-memory window is at most SHM_WARM_MB unless the test says
    (`--shm-warm-mb`, or `KVD_SHM_WARM_MB` in `env`): with the default, 4 GiB
    but at most the RAM budget, a daemon of the default budget (an eighth of
    this machine's memory, 3 GiB) spent ~0.5 s of CPU preparing memory in
    its first half second, on the core the other worker runs on, for the
    puts of a test that makes a few small ones. The tests of the window set
    their own."""

    namespace = "test"
    SHM_WARM_MB = "256"

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None, *,
                 host: str | None = None, **kw):
        host = host or os.environ.get("KVD_TEST_HOST")
        env = {"KVD_SHM_WARM_MB": self.SHM_WARM_MB, **({"KVD_HOST": host} if host else {}), **(env or {})}
        super().__init__(workdir, args, env, **kw)


@pytest.fixture
def kvd_host(request) -> str:
    """The host the daemons of this test run on: a seam test's parameter
    ("auto" or "portable"), else KVD_TEST_HOST's, else "auto"."""
    return getattr(request, "param", None) or os.environ.get("KVD_TEST_HOST") or "auto"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        item.kvd_failed = True  # daemon_factory prints its daemons' logs (below)
    return report


@pytest.fixture
def daemon_factory(kvd_host, request):
    started: list[DaemonProcess] = []
    dirs: list[str] = []

    def make(*args: str, start: bool = True, workdir: Path | None = None, env: dict | None = None) -> DaemonProcess:
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
            dirs.append(str(workdir))
        d = DaemonProcess(workdir, list(args), env, host=kvd_host)
        started.append(d)
        if start:
            d.start()
        return d

    yield make
    from kvd.server.shm.folders import plane_dirs, sweep_plane_dirs

    for d in started:
        d.stop()
        if getattr(request.node, "kvd_failed", False):  # shown with the failure ("Captured stdout teardown")
            print(f"--- the log of the daemon in {d.workdir} (its end):\n{d.log()[-6000:]}")
        # A daemon a test killed -9 leaves its shared-memory segments until
        # the next start on its endpoint, which a temp endpoint never sees
        # (shm_open objects are named from the folder: sweep them first).
        sweep_plane_dirs(d.workdir / "kvd.sock")
        for folder in plane_dirs(d.workdir / "kvd.sock"):
            shutil.rmtree(folder, ignore_errors=True)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kvd_daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory("--ram-mb", "256")
