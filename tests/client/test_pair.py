"""The helper thread that copies the other half of a big join (client/_pair.py)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading
import weakref

import pytest

from kvd_client import _pair


def test_both_halves_run_on_two_threads_and_both_return_first():
    ran = {}
    _pair.both(lambda: ran.setdefault("mine", threading.get_ident()),
               lambda: ran.setdefault("theirs", threading.get_ident()))
    assert ran["mine"] == threading.get_ident()
    if _pair._cores() > 1:
        assert ran["theirs"] != ran["mine"]
    else:
        assert ran["theirs"] == ran["mine"]


@pytest.mark.skipif(_pair._cores() < 2, reason="one core: no helper thread")
def test_what_either_half_raised_is_raised_here_once_both_have_returned():
    with pytest.raises(KeyError):
        _pair.both(lambda: None, lambda: {}["theirs"])
    gate, done, out = threading.Event(), [], []

    def theirs():
        gate.wait(10)
        done.append("theirs")

    def call():
        try:
            _pair.both(lambda: {}["mine"], theirs)
        except KeyError as err:
            out.append((err.args[0], list(done)))

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(0.2)
    assert caller.is_alive()  # mine has raised, theirs still runs: both() waits for it
    gate.set()
    caller.join(10)
    assert out == [("mine", ["theirs"])]
    _pair.both(lambda: None, lambda: None)  # the helper is free again


@pytest.mark.skipif(_pair._cores() < 2, reason="one core: no helper thread")
def test_a_caller_that_finds_the_helper_lent_runs_both_halves_itself():
    gate, lent = threading.Event(), threading.Event()
    first = threading.Thread(target=_pair.both, args=(lambda: None, lambda: (lent.set(), gate.wait(10))))
    first.start()
    assert lent.wait(10)
    ran = []
    _pair.both(lambda: ran.append(threading.get_ident()), lambda: ran.append(threading.get_ident()))
    assert ran == [threading.get_ident()] * 2
    gate.set()
    first.join(10)


def test_one_core_runs_both_halves_here_in_order(monkeypatch):
    monkeypatch.setattr(_pair, "_helper", None)
    monkeypatch.setattr(_pair, "_cores", lambda: 1)
    ran = []
    _pair.both(lambda: ran.append(("mine", threading.get_ident())), lambda: ran.append(("theirs", threading.get_ident())))
    assert ran == [("mine", threading.get_ident()), ("theirs", threading.get_ident())]


def _in_child(q):
    ran = []
    _pair.both(lambda: ran.append(threading.get_ident()), lambda: ran.append(threading.get_ident()))
    q.put((len(set(ran)), threading.get_ident() in ran))


@pytest.mark.skipif(_pair._cores() < 2, reason="one core: no helper thread")
def test_a_forked_child_gets_a_helper_of_its_own():
    _pair.both(lambda: None, lambda: None)  # the parent's helper exists before the fork
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(q,))
    child.start()
    assert q.get(timeout=30) == (2, True)
    child.join(30)
    assert child.exitcode == 0


def test_a_process_that_cannot_start_a_thread_runs_both_halves_here(monkeypatch):
    """At a pids limit (test_client_starved runs the real one) no helper is made:
    the join runs on the caller, and a helper is tried again next time."""
    monkeypatch.setattr(_pair, "_helper", None)
    monkeypatch.setattr(_pair, "_cores", lambda: 2)
    real = threading.Thread.start

    def refused(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)
    ran = []
    _pair.both(lambda: ran.append(threading.get_ident()), lambda: ran.append(threading.get_ident()))
    assert ran == [threading.get_ident()] * 2 and _pair._helper is None
    monkeypatch.setattr(threading.Thread, "start", real)
    _pair.both(lambda: None, lambda: None)
    assert _pair._helper is not None


@pytest.mark.skipif(_pair._cores() < 2, reason="one core: no helper thread")
def test_the_helper_keeps_nothing_of_a_call_once_it_has_returned():
    """The module rules: what the helper's half referred to (a join's memory) is freed
    when the caller lets it go, not held until the next call."""

    class Memory:
        pass

    memory = Memory()
    ref = weakref.ref(memory)
    _pair.both(lambda: None, lambda held=memory: held)
    del memory
    gc.collect()
    assert ref() is None


class _Interrupted(Exception):
    pass


@pytest.mark.skipif(_pair._cores() < 2, reason="one core: no helper thread")
def test_an_interrupt_while_waiting_is_raised_only_once_the_helpers_half_has_returned():
    """A signal's exception (Ctrl-C) while the caller waits for the helper
    must not let `both` return with the helper still writing the caller's memory."""
    import os
    import signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are handled on the main thread")
    lent, handled, gate, done = threading.Event(), threading.Event(), threading.Event(), []

    def handler(signum, frame):
        handled.set()
        raise _Interrupted()

    def theirs():
        lent.set()
        gate.wait(10)
        done.append("theirs")

    def interrupt():
        lent.wait(10)
        os.kill(os.getpid(), signal.SIGUSR1)
        handled.wait(10)
        gate.set()

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        t = threading.Thread(target=interrupt)
        t.start()
        with pytest.raises(_Interrupted):
            _pair.both(lambda: lent.wait(10), theirs)
        assert done == ["theirs"]
        t.join(10)
    finally:
        signal.signal(signal.SIGUSR1, old)
    _pair.both(lambda: None, lambda: None)  # the helper is free again


@pytest.mark.skipif(_pair._cores() < 2, reason="one core: no helper thread")
def test_an_error_from_the_helpers_half_keeps_nothing_alive_without_the_collector():
    """What the helper raised is raised here; caught and dropped, nothing its
    half referred to stays alive in a reference cycle until the collector runs."""

    class Memory:
        pass

    memory = Memory()
    ref = weakref.ref(memory)

    def theirs(held=memory):
        raise KeyError("theirs")

    del memory
    gc.disable()
    try:
        try:
            _pair.both(lambda: None, theirs)
        except KeyError:
            pass
        del theirs
        assert ref() is None
    finally:
        gc.enable()


def _child_after_fork_with_the_lock_held(q):
    ran = []
    _pair.both(lambda: ran.append(1), lambda: ran.append(2))
    q.put(sorted(ran))


def test_a_child_forked_while_another_thread_made_the_helper_is_not_stuck():
    """A fork while another thread holds the lock that makes the helper: the
    child gets a lock of its own (os.register_at_fork), not one held forever."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with _pair._made:  # as another thread would, making the helper at the fork
        child = ctx.Process(target=_child_after_fork_with_the_lock_held, args=(q,), daemon=True)
        child.start()
    assert q.get(timeout=30) == [1, 2]
    child.join(30)
    assert child.exitcode == 0


def test_fill_all_copies_every_piece_once_across_both_threads_and_stops_after_a_failure(monkeypatch):
    """`_chunking.fill_all`: the two threads take a job's pieces from one
    shared count (each piece once, whoever is free); once either raised, the
    other starts no further job."""
    import numpy as np

    from kvd_client import _chunking

    taken: list[tuple[int, int, str]] = []
    pieces = 64
    raws = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(4)]  # 4 MiB in all: shared out

    def fill(i, raw, share=None):
        for j in range(pieces) if share is None else share:
            if j >= pieces:
                break
            taken.append((i, j, threading.current_thread().name))
            raw[j * (len(raw) // pieces)] += 1

    _chunking.fill_all(fill, list(enumerate(raws)))
    assert sorted((i, j) for i, j, _ in taken) == [(i, j) for i in range(4) for j in range(pieces)]
    assert all(int(r.sum()) == pieces for r in raws)

    # The second half runs after the first raised in job 1 (as a helper would,
    # which `both` waits for whatever the caller's half raised): it starts no job.
    def both(mine, theirs):
        try:
            mine()
        finally:
            theirs()

    monkeypatch.setattr(_pair, "both", both)
    taken.clear()

    raised = []

    def failing(i, raw, share=None):
        if i == 1 and not raised:  # (one piece of job 1 damaged: the other half may take the rest of it)
            raised.append(i)
            raise ValueError("damaged")
        fill(i, raw, share)

    with pytest.raises(ValueError, match="damaged"):
        _chunking.fill_all(failing, list(enumerate(raws)))
    assert sorted({i for i, _, _ in taken}) == [0]  # neither job 2 nor 3
