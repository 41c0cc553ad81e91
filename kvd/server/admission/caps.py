"""How much the gate lets in: peers per fd limit, libzmq's I/O threads, the
listen backlog, and the memory the daemon allows itself (the ceiling the
gate's memory watchdog sheds against: kvd/server/admission/gate.py, rule 3).
"""

from __future__ import annotations

from kvd.host.fds import soft_fd_limit

# fds the daemon keeps for itself whatever the peers do: ZeroMQ's eventfds and
# epoll, LMDB, blob files being written and read, the log, the metrics server.
RESERVE_FDS = 64


def default_max_peers(fd_limit: int | None = None) -> int:
    """Peers allowed by default under a soft fd limit (this process's, if
    None): half the limit less the daemon's own reserve. The other half is
    kept free for the connections libzmq accepts in a burst before the gate
    pauses it (measured: ~100 under prlimit 256 with 4 x 2,000 connects)."""
    if fd_limit is None:
        fd_limit = soft_fd_limit()
    return max(8, fd_limit // 2 - RESERVE_FDS)


def io_threads(fd_limit: int | None = None) -> int:
    """libzmq I/O threads for a daemon under a soft fd limit (this process's,
    if None). Two spread peers' connections, so one peer's big message being
    read does not hold up everyone's small ones (bench_stress). But with two,
    the thread that accepts hands new connections to the other and accepts
    faster: under prlimit 256 the gate's windows let enough through for
    libzmq to abort on EMFILE (2 in 20 runs, 0 in 20 with one). So two only
    where the fd table has thousands to spare (service managers' limits)."""
    if fd_limit is None:
        fd_limit = soft_fd_limit()
    return 2 if fd_limit >= 8192 else 1


def listen_backlog(max_peers: int) -> int:
    """The listener's backlog: libzmq's default (100), less under a small cap.
    While the gate has the listener open, what waits there is accepted in one
    burst, before the gate has read a single ACCEPTED event."""
    return max(8, min(100, max_peers // 4))


# What the daemon's process holds besides the RAM tier's entries and messages:
# the interpreter, libzmq, the index's bookkeeping, the EXPLAIN records, the
# requests of heavy peers waiting their turn (at most 32 MiB, kvd.server.admission.turns).
BASE_ALLOWANCE = 160 << 20
# Shared-memory PUTs awaiting their COMMIT keep their requests (tokens, metas):
# at most this or max_message_bytes, whichever is less (kvd.server.shm.plane rule 3).
PENDING_ALLOWANCE = 64 << 20


def memory_ceiling(ram_bytes: int, limits) -> int:
    """Anonymous RSS the daemon allows itself: the RAM tier's bytes (entries'
    overhead included; the caller adds the spill queue's entries RAM no longer
    holds) + BASE_ALLOWANCE + 3 x max_message_bytes: queued replies
    are held to 2x in total (kvd.server.admission.outbox), 1x is for messages arriving
    -- + what shared-memory PUTs awaiting COMMIT hold (PENDING_ALLOWANCE or
    1x, whichever is less). Over it, the gate sheds stalled peers (rule 3)."""
    return ram_bytes + BASE_ALLOWANCE + 3 * limits.max_message_bytes + min(limits.max_message_bytes, PENDING_ALLOWANCE)
