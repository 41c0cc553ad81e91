"""`kvd doctor`, the real command in a child process: healthy against a real
daemon, then one thing broken at a time -- a run dir other users may enter,
an unreachable daemon, a full disk, an fd limit of 64, an mlx that cannot be
imported -- each time checking
that the matching line says so, and the exit status (1 only for a failure).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support import kvd

NAMES = ["host", "python", "packages", "redis", "mlx", "endpoint", "daemon", "fd limit", "memory", "shared memory",
         "data dir", "fsync", "pressure", "service", "vllm-mlx", "mlx-lm server"]


def checks(out: str) -> dict[str, dict]:
    """The --json output's checks by name (and it is one JSON object)."""
    doc = json.loads(out)
    assert [c["name"] for c in doc["checks"]] == NAMES, doc
    assert all(set(c) == {"name", "status", "detail", "mechanism"} for c in doc["checks"])
    return {c["name"]: c for c in doc["checks"]}


def lines(out: str) -> dict[str, str]:
    """The text output's lines by check name: `status detail [mechanism]`."""
    found = {}
    for line in out.splitlines()[:-1]:
        status, rest = line.split(None, 1)
        name = next(n for n in sorted(NAMES, key=len, reverse=True) if rest.startswith(n + " "))
        found[name] = f"{status} {rest[len(name):].strip()}"
    assert list(found) == NAMES, out
    return found


def run(*args: str, env: dict | None = None, prefix: tuple[str, ...] = (), preexec=None) -> subprocess.CompletedProcess:
    """`kvd doctor ARGS` with another environment, under a wrapper command, or a preexec_fn."""
    return subprocess.run([*prefix, sys.executable, "-m", "kvd", "doctor", *args], capture_output=True, text=True,
                          timeout=180, env=env, preexec_fn=preexec)


@pytest.fixture
def folder():
    """A short private folder for an endpoint (ipc paths are limited to ~104 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvd-doc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# A seam test's portable run (tests/conftest.py) reaches this file's tests only
# through daemons the fixtures start: `kvd doctor` itself sees no KVD_*
# variable but those a test gives it (support.kvd drops them; `run` passes
# KVD_TEST_HOST, which kvd never reads), so the others would run the same
# doctor twice.
@pytest.mark.seam
def test_healthy_against_a_real_daemon(kvd_daemon):
    where = ("--endpoint", kvd_daemon.endpoint, "--data-dir", str(kvd_daemon.data_dir), "--config", str(kvd_daemon.config))
    text = kvd("doctor", *where, timeout=180)
    assert text.returncode == 0, text.stdout + text.stderr
    shown = lines(text.stdout)
    assert all(line.startswith(("ok ", "warn ")) for line in shown.values()), text.stdout
    assert shown["daemon"].startswith("ok answers at " + kvd_daemon.endpoint), shown["daemon"]
    assert shown["endpoint"].startswith("ok ") and "mode 0700" in shown["endpoint"], shown["endpoint"]
    assert shown["fsync"].startswith("ok 64 KiB written, synced and read back in " + str(kvd_daemon.data_dir))
    assert text.stdout.splitlines()[-1].startswith("kvd doctor: 0 failed")

    out = kvd("doctor", "--json", *where, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0
    assert {c["status"] for c in checks(out.stdout).values()} <= {"ok", "warn"}


def test_a_run_dir_you_chose_that_others_may_enter_is_a_warning(folder):
    run_dir = folder / "run"
    run_dir.mkdir(mode=0o755)
    run_dir.chmod(0o755)
    out = kvd("doctor", "--endpoint", f"ipc://{run_dir}/kvd.sock", "--data-dir", str(folder / "data"), timeout=180)
    shown = lines(out.stdout)
    assert shown["endpoint"].startswith("warn ") and "has mode 0755" in shown["endpoint"], shown["endpoint"]
    assert "kvd does not refuse it" in shown["endpoint"]
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_default_run_dir_others_may_enter_is_a_failure(folder):
    # $XDG_RUNTIME_DIR/kvd is the default run dir (kvd.endpoint rule 3): the
    # daemon and every client refuse it at 0755, so doctor fails.
    (folder / "kvd").mkdir(mode=0o755)
    (folder / "kvd").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")} | {"XDG_RUNTIME_DIR": str(folder)}
    out = run("--json", "--data-dir", str(folder / "data"), env=env)
    got = checks(out.stdout)
    assert got["endpoint"]["status"] == "fail", got["endpoint"]
    assert f"{folder}/kvd" in got["endpoint"]["detail"] and "has mode 0755" in got["endpoint"]["detail"]
    assert [c for c in got.values() if c["status"] == "fail"] == [got["endpoint"]]
    assert out.returncode == 1 and json.loads(out.stdout)["exit_code"] == 1


def test_an_unreachable_daemon_is_a_warning_not_a_failure(folder):
    endpoint = f"ipc://{folder}/kvd.sock"  # a private folder where nothing listens
    out = kvd("doctor", "--endpoint", endpoint, "--data-dir", str(folder / "data"), timeout=180)
    shown = lines(out.stdout)
    assert shown["daemon"].startswith(f"warn none answers at {endpoint}"), shown["daemon"]
    assert shown["endpoint"].startswith("ok "), shown["endpoint"]
    assert out.returncode == 0, out.stdout + out.stderr


def test_an_fd_limit_of_64_is_a_warning(folder):
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    out = run("--json", "--endpoint", f"ipc://{folder}/kvd.sock", "--data-dir", str(folder / "data"), preexec=limit)
    got = checks(out.stdout)
    fd = got["fd limit"]
    assert fd["status"] == "warn" and fd["detail"].startswith("soft 64, hard 64; kvd serve raises the soft limit to 64"), fd
    assert "under 1024" in fd["detail"]
    assert out.returncode == 0, out.stdout + out.stderr


def _mount_namespace() -> tuple[str, ...] | None:
    """A wrapper that runs a command in its own mount namespace (as root in a
    user namespace when not root), or None if this machine allows neither."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    wrapper = (unshare, "-m") if os.geteuid() == 0 else (unshare, "-rm")
    probe = subprocess.run([*wrapper, "true"], capture_output=True, timeout=30)
    return wrapper if probe.returncode == 0 else None


def test_a_full_disk_fails_the_write_and_warns_on_space(folder):
    wrapper = _mount_namespace()
    if wrapper is None:
        pytest.skip("no tiny filesystem to fill: unshare cannot make a mount namespace here (needs root or user namespaces)")
    disk = folder / "disk"
    disk.mkdir()
    # In its own mount namespace: a 64 KiB tmpfs, filled, then doctor on it.
    script = (f'mount -t tmpfs -o size=64k kvd-doctor-full "{disk}" || exit 97\n'
              f'dd if=/dev/zero of="{disk}/fill" bs=4k 2>/dev/null\n'
              f'exec "$@"\n')
    out = run("--json", "--endpoint", f"ipc://{folder}/kvd.sock", "--data-dir", str(disk / "data"),
              prefix=(*wrapper, "sh", "-c", script, "sh"))
    if out.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {out.stderr.strip()}")
    got = checks(out.stdout)
    assert got["data dir"]["status"] == "warn", got["data dir"]
    assert "0 B free of 64.0 KiB, tmpfs" in got["data dir"]["detail"] and "under min_free_gb" in got["data dir"]["detail"]
    assert got["fsync"]["status"] == "fail" and "No space left on device" in got["fsync"]["detail"], got["fsync"]
    assert out.returncode == 1, out.stdout + out.stderr


def test_an_mlx_that_cannot_be_imported_is_a_warning_not_a_crash(folder, tmp_path):
    # A package named mlx that raises on import, first on the path: doctor
    # imports mlx only in its child process, which says so in a line.
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text('raise ImportError("broken on purpose")\n')
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = run("--json", "--endpoint", f"ipc://{folder}/kvd.sock", "--data-dir", str(folder / "data"), env=env)
    got = checks(out.stdout)
    assert got["mlx"]["status"] == "warn" and "cannot import mlx: ImportError: broken on purpose" in got["mlx"]["detail"]
    assert out.returncode == 0, out.stdout + out.stderr


def test_it_names_the_mechanism_this_os_gives(folder):
    # The memory, fsync and pressure lines say where their readings come from:
    # on Linux /proc and fsync; on a Mac proc_pid_rusage, F_FULLFSYNC and sysctl.
    out = run("--json", "--endpoint", f"ipc://{folder}/kvd.sock", "--data-dir", str(folder / "data"))
    got = checks(out.stdout)
    mac = sys.platform == "darwin"
    assert got["memory"]["status"] == "ok", got["memory"]  # the watchdog can read RSS on both OSes
    assert got["memory"]["mechanism"].startswith("proc_pid_rusage ri_phys_footprint" if mac else "/proc/self/statm")
    assert got["fsync"]["status"] == "ok"
    assert got["fsync"]["mechanism"] == ("fsync (F_FULLFSYNC only with full_fsync = true)" if mac else "fsync (no F_FULLFSYNC here)")
    assert got["pressure"]["mechanism"] == ("sysctl kern.memorystatus_vm_pressure_level" if mac else "/proc/meminfo, PSI, cgroups")
    assert got["pressure"]["detail"].startswith(("auto: normal", "auto: warn", "auto: critical")), got["pressure"]
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_portable_host_is_what_it_names(folder):
    # KVD_HOST=portable (the developer setting CI uses to run macOS's mechanisms
    # here): doctor makes its trial segment as a POSIX shm_open object with no
    # name, gets it back by fd from the daemon's own hand-out service, and says so.
    env = os.environ | {"KVD_HOST": "portable"}
    out = run("--json", "--endpoint", f"ipc://{folder}/kvd.sock", "--data-dir", str(folder / "data"), env=env)
    got = checks(out.stdout)
    shm = got["shared memory"]
    assert shm["status"] == "ok" and shm["mechanism"].startswith("POSIX shm_open object"), shm
    # Every concern's choice is named, and the lines that use one follow it.
    assert got["host"]["detail"] == ("portable: shared_memory shm_open, open_fds /dev/fd, accept_guard gate only, "
                                     "memory_pressure meminfo+cgroup, process_memory statm, "
                                     "peer_credentials SO_PEERCRED, service systemd, shared_memory_pages 4 KiB"), got["host"]
    assert "open fds from /dev/fd" in got["fd limit"]["mechanism"] and "gate only" in got["fd limit"]["mechanism"]
    assert got["pressure"]["mechanism"] == "/proc/meminfo, cgroups (no PSI)" and "psi" not in got["pressure"]["detail"]
    auto = checks(run("--json", "--endpoint", f"ipc://{folder}/kvd.sock", "--data-dir", str(folder / "data")).stdout)
    assert auto["host"]["detail"].startswith("auto: shared_memory memfd, open_fds /proc/self/fd, accept_guard patched accept")
    assert "handed out by fd" in shm["mechanism"] and "handed over by fd" in shm["detail"], shm


@pytest.mark.skipif(sys.platform != "darwin", reason="a real Mac's doctor: launchd, Metal, F_FULLFSYNC")
def test_on_a_mac_every_line_is_ok_or_a_warning():
    out = run("--json")
    doc = json.loads(out.stdout)
    assert doc["ok"] is True and out.returncode == 0, out.stdout
    got = checks(out.stdout)
    assert got["service"]["mechanism"] == "launchd" or "launchd" in got["service"]["detail"], got["service"]
