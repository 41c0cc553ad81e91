"""Exit codes of every kvd command, and the one table mapping errors to them.

Every command runs under `kvd.cli.main`, which catches what `describe`
knows -- kvd's own errors (the KvdError tree, kvd/protocol/errors.py) and
environment faults (OSError, LMDB's errors) -- and prints one line, `kvd:
<what went wrong>`, then exits with the code below. Anything else is a bug
in kvd and keeps its traceback.
"""

from __future__ import annotations

OK = 0  # done
FAILED = 1  # the command ran and failed (see its message), or the environment refused (a file, a disk, a thread)
USAGE = 2  # bad flags or arguments (click's own code)
UNAVAILABLE = 3  # no daemon answered at the endpoint
REFUSED = 4  # the daemon answered with an error, or holds what was asked for (endpoint, data dir)
CONFIG = 78  # bad configuration (sysexits EX_CONFIG), from any source: service managers stop restarting


def thread_refused(err: BaseException) -> bool:
    """Did starting a thread fail because the system would not make one (a
    pids cgroup, RLIMIT_NPROC, no memory for a stack)? CPython says so with a
    RuntimeError, not an OSError; it is the environment's refusal, not a bug."""
    return isinstance(err, RuntimeError) and "can't start new thread" in str(err)


THREAD_REFUSED = "cannot start a thread: the system refused one (a pids limit or RLIMIT_NPROC reached?)"


def describe(err: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) for an error a command may meet; None for a bug."""
    # Imported here: this runs only on the way out, and `kvd serve` must not
    # pay for the client, LMDB or the service modules to start.
    import lmdb

    from kvd.config import ConfigError
    from kvd.endpoint import EndpointBusy, EndpointError
    from kvd.protocol.errors import KvdError, ProtocolError, ServerError
    from kvd.service.install import ServiceError
    from kvd.store.datadir import DataDirBusy
    from kvd.store.ssd.index import IncompatibleIndex
    from kvd_client import AuthenticationFailed, DaemonUnavailable

    if isinstance(err, AuthenticationFailed):
        return REFUSED, f"{err} (see `kvd keys`)"
    if isinstance(err, DaemonUnavailable):
        return UNAVAILABLE, f"{err} (is `kvd serve` running?)" if str(err).startswith("no daemon") else str(err)
    # UnsafeEndpoint (a run dir or socket another user may own) is an
    # EndpointError: 78, since restarting will not make the directory ours.
    if isinstance(err, (ConfigError, EndpointError)) and not isinstance(err, EndpointBusy):
        return CONFIG, str(err)
    if isinstance(err, (ProtocolError, ServerError)):
        return REFUSED, f"daemon refused: {err.name}: {err}"
    if isinstance(err, (EndpointBusy, DataDirBusy, IncompatibleIndex)):
        return REFUSED, str(err)
    if isinstance(err, ServiceError):
        return err.exit_code, str(err)
    if isinstance(err, KvdError):
        return FAILED, str(err)
    if isinstance(err, UnicodeEncodeError):  # an argument the shell passed as bytes no UTF-8 has (a namespace)
        return USAGE, f"an argument is not UTF-8 text: {err.object[err.start:err.end]!r} in {err.object!r}"
    if isinstance(err, OSError):
        what = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
        return FAILED, what
    if isinstance(err, lmdb.Error):  # the index cannot be opened (permissions, a full or read-only disk)
        return FAILED, f"cannot use the index: {err}"
    if thread_refused(err):
        return FAILED, THREAD_REFUSED
    return None
