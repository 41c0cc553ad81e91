"""kvd.service.systemd: the user unit, checked by systemd-analyze and by running
the real daemon under the unit's MemoryDenyWriteExecute= restriction."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvd.service import systemd

from support import REPO

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze not installed (apt-get install -y systemd)"
)


def unit_settings(text: str) -> dict[str, list[str]]:
    """Active (uncommented) Key=value lines, by key."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `systemd-analyze --user verify` on the text saved as kvd.service."""
    d = tmp_path / "units"
    d.mkdir(exist_ok=True)
    (d / "kvd.service").write_text(unit_text)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_COLOR": "0"}
    return subprocess.run(
        [ANALYZE, "--user", "verify", str(d / "kvd.service")],
        capture_output=True, text=True, env=env, timeout=60,
    )


def test_unit_contents():
    text = systemd.render_unit(sys.executable)
    s = unit_settings(text)
    assert s["Type"] == ["notify"]
    assert s["ExecStart"] == [
        f"{sys.executable} -m kvd serve --endpoint ipc://%t/kvd/kvd.sock --data-dir %C/kvd"
    ]
    assert s["Restart"] == ["on-failure"]
    assert s["RestartPreventExitStatus"] == ["78"]
    assert int(s["WatchdogSec"][0]) >= 10
    assert s["RuntimeDirectory"] == ["kvd"] and s["CacheDirectory"] == ["kvd"]
    assert s["UMask"] == ["0077"]
    # kvd ends a stop within stop_timeout (10 s): systemd waits a little more, never 90 s.
    assert s["TimeoutStopSec"] == ["15"]
    assert unit_settings(systemd.render_unit(sys.executable, stop_timeout=42.5))["TimeoutStopSec"] == ["48"]
    for key in ("NoNewPrivileges", "LockPersonality", "RestrictRealtime", "MemoryDenyWriteExecute"):
        assert s[key] == ["yes"], key
    assert s["SystemCallArchitectures"] == ["native"]
    # Namespace-based hardening is offered, commented out (it breaks without user namespaces).
    for key in ("PrivateTmp", "ProtectSystem", "ProtectHome"):
        assert key not in s and f"\n#{key}=" in text, key
    assert s["WantedBy"] == ["default.target"]
    assert text.startswith("# kvd.service") and "adapt" in text.split("[Unit]")[0]


def test_exec_start_quoting_and_extra_args():
    text = systemd.render_unit("/opt/my env/100%/python", extra_args=("--ram-mb", "4096", "--log-file", "/a b"))
    (line,) = unit_settings(text)["ExecStart"]
    assert line.startswith('"/opt/my env/100%%/python" -m kvd serve ')
    assert line.endswith(' --ram-mb 4096 --log-file "/a b"')
    with pytest.raises(ValueError, match="absolute"):
        systemd.render_unit("python3")


def test_unit_path(tmp_path):
    assert str(systemd.unit_path("/home/a")) == "/home/a/.config/systemd/user/kvd.service"
    assert str(systemd.unit_path("/home/a", {"XDG_CONFIG_HOME": "/cfg"})) == "/cfg/systemd/user/kvd.service"


def test_repository_example_is_current():
    example = (REPO / "systemd" / "kvd.service").read_text()
    assert example == systemd.render_unit(systemd.EXAMPLE_PYTHON), (
        "regenerate: python -m kvd.service.systemd > systemd/kvd.service"
    )


@needs_analyze
def test_systemd_analyze_verify_is_silent(tmp_path):
    r = verify(systemd.render_unit(sys.executable), tmp_path)
    assert (r.returncode, r.stderr, r.stdout) == (0, "", "")


@needs_analyze
def test_systemd_analyze_verify_quoted_path(tmp_path):
    odd = tmp_path / "py dir" / "100%"
    odd.mkdir(parents=True)
    (odd / "python").symlink_to(sys.executable)
    r = verify(systemd.render_unit(odd / "python", extra_args=("--ram-mb", "64")), tmp_path)
    assert (r.returncode, r.stderr) == (0, "")


@needs_analyze
@pytest.mark.skipif(not os.access(systemd.EXAMPLE_PYTHON, os.X_OK), reason=f"no {systemd.EXAMPLE_PYTHON}")
def test_systemd_analyze_verify_repository_example(tmp_path):
    r = verify((REPO / "systemd" / "kvd.service").read_text(), tmp_path)
    assert (r.returncode, r.stderr) == (0, "")


@needs_analyze
def test_verify_would_catch_a_misspelled_key(tmp_path):
    # systemd-analyze exits 0 for unknown keys: only stderr tells, so check it does.
    text = systemd.render_unit(sys.executable).replace("UMask=0077", "UMask=0077\nWatchDogSec=30")
    r = verify(text, tmp_path)
    assert r.returncode == 0 and "WatchDogSec" in r.stderr


# MemoryDenyWriteExecute= is seccomp in systemd; PR_SET_MDWE (Linux >= 6.3) is the
# same rule from prctl: no mapping may be writable and executable, and none may
# gain PROT_EXEC later. The daemon runs under it here, end to end.
_MDWE_BOOT = r"""
import ctypes, mmap, runpy, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    sys.exit(77)
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit(78)  # MDWE not in force: the test would prove nothing
except OSError:
    pass
import numpy, zmq, lmdb, xxhash, msgpack  # the daemon's native dependencies
sys.argv = ["kvd"] + sys.argv[1:]
runpy.run_module("kvd", run_name="__main__", alter_sys=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_MDWE is Linux-only")
def test_daemon_runs_under_memory_deny_write_execute():
    from kvd_client import Client

    d = tempfile.mkdtemp(prefix="kvdm-", dir="/tmp")
    endpoint = f"ipc://{d}/k.sock"
    log = open(os.path.join(d, "log"), "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", _MDWE_BOOT, "serve", "--endpoint", endpoint, "--ram-mb", "64", "--data-dir", f"{d}/data"],
        stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    try:
        deadline, rtt = time.monotonic() + 20, None
        with Client(endpoint, namespace="mdwe", timeout=0.5) as c:
            while rtt is None and time.monotonic() < deadline and proc.poll() is None:
                rtt = c.ping()
        if proc.poll() == 77:
            pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3)")
        log.seek(0)
        assert rtt is not None, f"daemon under MDWE did not answer (exit {proc.poll()}):\n{log.read()}"
    finally:
        if proc.poll() is None:
            proc.terminate()
        code = proc.wait(10)
        log.close()
        shutil.rmtree(d, ignore_errors=True)
    assert code == 0


def test_default_stop_timeout_matches_the_settings_table():
    from kvd.config import BY_NAME

    assert systemd.DEFAULT_STOP_TIMEOUT == BY_NAME["stop_timeout"].default
