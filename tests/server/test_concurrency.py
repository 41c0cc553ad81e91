"""Many clients at once: threads sharing one Client, and several processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np

from support import TESTS, prefix_snapshot

WORKER = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from support import prefix_snapshot
    from kvd_client import Client
    wid = {wid}
    with Client({endpoint!r}, namespace="procs", strict=True) as c:
        for i in range(6):
            toks = np.arange(300 + 50 * i) + 100_000 * wid
            snap = prefix_snapshot(toks)
            assert c.put(toks, snap)
            hit = c.get(toks)
            assert hit.n == len(toks)
            for name, (t, _) in snap.sliced.items():
                assert hit.sliced[name].equal(t), name
    """
)


def test_threads_share_one_client(kvd_daemon):
    errors: list[BaseException] = []
    with kvd_daemon.client("threads", strict=True) as c:

        def work(wid: int) -> None:
            try:
                for i in range(5):
                    toks = np.arange(260 + i) + 10_000 * wid
                    snap = prefix_snapshot(toks)
                    assert c.put(toks, snap)
                    hit = c.get(toks)
                    assert hit.n == len(toks)
                    for name, (t, _) in snap.sliced.items():
                        assert hit.sliced[name].equal(t)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        assert c.stats()["namespaces"]["threads"]["puts"] == 30


def test_processes_in_parallel(kvd_daemon):
    tests = str(TESTS)
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER.format(tests=tests, endpoint=kvd_daemon.endpoint, wid=w)])
        for w in range(4)
    ]
    assert [p.wait(120) for p in procs] == [0, 0, 0, 0]
    with kvd_daemon.client("procs", strict=True) as c:
        assert c.stats()["namespaces"]["procs"]["gets"] == 24
