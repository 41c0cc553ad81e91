"""A host that refuses what `kvd serve` needs to start: real cgroups, real daemons.

Under a pids limit too small for its threads, a start had failed three ways
depending on which thread could not start: a Python traceback (exit 1), a
libzmq abort (SIGABRT, src/thread.cpp) or exit 4 -- the code that says
another daemon holds the endpoint -- leaving its /dev/shm plane folder
behind. Now it is one error line, exit 1 (kvd.cli.exits: the environment
refused), and nothing left behind.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from kvd.cli import exits
from kvd.server.shm.folders import plane_dirs


def _pids_cgroup(limit: int) -> Path:
    """A fresh pids cgroup (v1 hierarchy, else v2 with the pids controller)
    allowing `limit` tasks; skips the test where none can be made."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a pids cgroup")
    v1, v2 = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")
    if (v1 / "cgroup.procs").exists():
        root = v1
    elif _v2_has_pids(v2):
        root = v2
    else:
        pytest.skip("no pids cgroup controller here (v1 pids hierarchy or v2 with pids enabled)")
    group = root / f"kvd-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "pids.max").write_text(str(limit))
    except OSError as err:
        pytest.skip(f"cannot make a pids cgroup: {err}")
    return group


def _v2_has_pids(root: Path) -> bool:
    """Is `root` a cgroup v2 mount whose children get the pids controller?"""
    try:
        return "pids" in (root / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


def _remove_cgroup(group: Path) -> None:
    for _ in range(50):  # the daemon's tasks leave it a moment after it exits
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


@pytest.mark.parametrize("tasks", [2, 4, 6])
def test_a_start_refused_a_thread_is_one_line_and_exit_1(daemon_factory, tasks):
    """2 tasks: the SSD writer cannot start (was a traceback); 4 and 6:
    libzmq's threads (was SIGABRT). Now `kvd serve` tries the threads bind
    needs before libzmq starts its own, and stops there. (A limit just short
    of what bind needs had also given exit 4 and left a /dev/shm folder; how
    many that is depends on the host -- libzmq's I/O threads follow the fd
    limit -- so a fixed limit cannot aim at it: a daemon that starts is no
    verdict. 6 is below any daemon's need: main, writer, gate, libzmq's I/O
    thread and reaper, pyzmq's collector, its context's two.)"""
    group = _pids_cgroup(tasks)
    try:
        d = daemon_factory("--ram-mb", "64", "--write-through", start=False)
        command = d.command()  # started inside the cgroup, as a service manager would
        d.command = lambda: ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *command]
        d.start(wait=False)
        try:
            code = d.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"started under pids.max={tasks}?\n{d.log()}")
        log = d.log()
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert code == exits.FAILED and "Traceback" not in log, log
        assert len(errors) == 1 and "cannot start a thread" in errors[0], log
        assert plane_dirs(d.workdir / "kvd.sock") == []  # no /dev/shm folder outlives the run
    finally:
        _remove_cgroup(group)
