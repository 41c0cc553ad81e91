"""The client in a model server at its thread limit (a container's pids
limit, systemd's TasksMax): a PUT over frames still stores, or says not
stored -- it never raises (README "Failure behaviour").

pyzmq starts its garbage-collector thread on the first zero-copy send, the
first PUT of tensor bytes; a process out of threads by then got RuntimeError
out of `Client.put`. The limit is real: a cgroup v1 pids group the client's
process joins, its pids.max set to the tasks it has (not one thread more).
The client runs in a child process (CHILD below), so only it is starved.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import wait_until

PIDS = Path("/sys/fs/cgroup/pids")

# argv: endpoint, cgroup folder, scenario. Prints one JSON line of results;
# an exception out of the client is a result ("raised"), not a crash.
CHILD = r'''
import json, os, sys
import numpy as np
from kvd_client import Client, HostTensor, Snapshot

endpoint, group, scenario = sys.argv[1:4]
tokens = list(range(1000, 1512))
kv = np.random.default_rng(0).integers(0, 255, (1, 512, 4096), np.uint8)  # 2 MiB: zero-copy frames
snap = Snapshot(sliced={"k": (HostTensor.from_numpy(kv), 1)})


def starve():
    """Join the group and allow it not one task more than it has."""
    with open(f"{group}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    with open(f"{group}/pids.current") as f:
        current = f.read().strip()
    with open(f"{group}/pids.max", "w") as f:
        f.write(current)


def lift():
    with open(f"{group}/pids.max", "w") as f:
        f.write("max")


def put(c):
    try:
        return c.put(tokens, snap)
    except BaseException as err:
        return f"raised {type(err).__name__}: {err}"


def exact(c):
    hit = c.get(tokens)
    return hit is not None and hit.n == 512 and np.array_equal(np.asarray(hit.sliced["k"].array), kv)


def report(out, c):
    out["counters"] = dict(c.counters)
    print(json.dumps(out), flush=True)


c = Client(endpoint, namespace="starved", timeout=5, chunk_tokens=256, transport="frames")
out = {"ping": c.ping() is not None}
if scenario == "limit":
    starve()
    out["put"] = put(c)
    out["exact"] = exact(c)
    report(out, c)
elif scenario in ("no-collector", "no-collector-after-a-slow-answer"):
    import zmq.utils.garbage
    zmq.utils.garbage.gc.stop()  # as if never started: the first zero-copy send starts it
    if scenario == "no-collector-after-a-slow-answer":
        # The PUT's call has its LOOKUP answered, 50 ms late, before its send
        # fails here: more than the budget a 2 MiB PUT adds to `timeout`.
        import time
        from kvd_client import _transport
        plain = _transport.Transport.request

        def slow(self, mtype, fields, timeout):
            reply = plain(self, mtype, fields, timeout)
            if mtype == "LOOKUP":
                time.sleep(0.05)
            return reply

        _transport.Transport.request = slow
    starve()
    out["put"] = put(c)
    lift()
    out["put_after"] = put(c)
    out["exact"] = exact(c)
    report(out, c)
elif scenario == "fork":
    pid = os.fork()
    if pid == 0:
        out = {"ping": c.ping() is not None}  # the child's own socket (and threads)
        starve()
        out["put"] = put(c)
        out["exact"] = exact(c)
        report(out, c)
        os._exit(0)
    os.waitpid(pid, 0)
'''

_groups = itertools.count()


@pytest.fixture
def pids_group():
    """A cgroup v1 pids group of its own, removed after the test (its
    leftover tasks moved back to the root group first)."""
    if not (PIDS / "cgroup.procs").exists() or not os.access(PIDS, os.W_OK):
        pytest.skip("needs a writable cgroup v1 pids hierarchy at /sys/fs/cgroup/pids (root)")
    group = PIDS / f"kvd-test-starved-{os.getpid()}-{next(_groups)}"
    group.mkdir()
    yield group
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (PIDS / "cgroup.procs").write_text(pid)
        except OSError:
            pass  # gone meanwhile

    def removed() -> bool:
        try:
            group.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False  # a task that just exited is not released yet
        return True

    wait_until(removed, timeout=10, what=f"{group} removed")


def _run_child(d, group: Path, scenario: str) -> dict:
    """CHILD's results for `scenario`, against daemon `d`."""
    done = subprocess.run([sys.executable, "-c", CHILD, d.endpoint, str(group), scenario],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result:\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[-1])


def test_the_first_frames_put_at_the_pids_limit_is_stored(daemon_factory, pids_group):
    """Regression (a red-team find): the collector was started by the first
    PUT, and at the limit that raised RuntimeError; it is started when the
    client is made now, so the PUT needs no thread."""
    d = daemon_factory("--ram-mb", "64")
    out = _run_child(d, pids_group, "limit")
    assert out["ping"]
    assert out["put"] is True, out
    assert out["exact"], out


@pytest.mark.parametrize("scenario", ["no-collector", "no-collector-after-a-slow-answer"])
def test_a_collector_that_cannot_start_is_a_put_not_stored_and_the_next_put_stores(
    daemon_factory, pids_group, scenario
):
    """A zero-copy send that cannot start its thread anyway is a failed call
    (not stored, counted as unavailable), never an exception; the socket the
    cut-short message was on is remade, so the next PUT, once the limit is
    lifted, stores exactly what it sent. Unavailable even when the daemon
    answered an earlier request of the same call late (its LOOKUP): no budget
    ran out, so it is not `out_of_time` (was, when the LOOKUP took longer than
    the few ms a PUT's size adds to its budget: 3 failures in ~46 runs)."""
    d = daemon_factory("--ram-mb", "64")
    out = _run_child(d, pids_group, scenario)
    assert out["ping"]
    assert out["put"] is False, out
    assert out["counters"]["put_failed"] == 1 and out["counters"].get("error_unavailable", 0) == 1, out
    assert "error_out_of_time" not in out["counters"], out
    assert out["put_after"] is True, out
    assert out["exact"], out


def test_a_forked_child_at_the_pids_limit_stores_its_first_frames_put(daemon_factory, pids_group):
    """ZeroMQ's threads do not cross a fork: the child's transport starts its
    own (collector included) when it remakes its socket, not at its first PUT."""
    d = daemon_factory("--ram-mb", "64")
    out = _run_child(d, pids_group, "fork")
    assert out["ping"]
    assert out["put"] is True, out
    assert out["exact"], out
