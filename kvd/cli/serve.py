"""`kvd serve`: run the daemon in the foreground."""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import time
from typing import NoReturn

import click

from kvd.cli import exits, main
from kvd.config import BY_NAME, ConfigError, config_options, resolve
from kvd.host.select import mechanisms as host_mechanisms
from kvd.host.threads import task_count
from kvd.host.select import use as select_host
from kvd.protocol.limits import MiB, Limits

GiB = 1 << 30
LOG_FORMAT = "%(asctime)s kvd[%(process)d] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, log_file: str | None = None) -> None:
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    # A log that cannot be written (a full disk) loses its lines, never
    # floods stderr with a traceback per line.
    logging.raiseExceptions = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _refused_thread(log: logging.Logger, err: RuntimeError, doing: str, store=None) -> NoReturn:
    """A thread the start needs cannot start (a pids limit, RLIMIT_NPROC):
    one line and exit 1, the table's code for the environment's refusal
    (kvd.cli.exits), after letting go of the store if it is open. Not 4,
    which says another daemon holds the endpoint; not 78, since the same
    start may succeed once the host has tasks to spare. Any other
    RuntimeError is a bug and keeps its traceback."""
    if not exits.thread_refused(err):
        raise err
    log.error("%s, %s: not starting", exits.THREAD_REFUSED, doing)
    if store is not None:
        store.close()
    raise SystemExit(exits.FAILED)


def _threads_bind_starts(endpoint: str, zmq_io_threads: int) -> int:
    """Threads Daemon.bind starts: libzmq's for our context (its I/O threads
    and a reaper), pyzmq's zero-copy collector (a thread, and a context of its
    own with an I/O thread and a reaper), the peer gate, and on tcp the ZAP
    authenticator."""
    from kvd.endpoint import is_tcp

    return zmq_io_threads + 1 + 3 + 1 + (1 if is_tcp(endpoint) else 0)


def _threads_fit(n: int) -> bool:
    """Can `n` more threads start now? libzmq aborts the process (SIGABRT,
    src/thread.cpp) when it cannot start one, where Python raises: so before
    it starts its own, as many are started here, then let go, and their
    tasks waited for until the kernel has released them (kvd/host/threads.py:
    a thread joined in Python still counts against a pids limit for a
    moment). A probe, not a reservation: another process in the same
    cgroup can still take the last task in between."""
    before, go, started = task_count(), threading.Event(), []
    try:
        for _ in range(n):
            t = threading.Thread(target=go.wait, name="kvd-thread-probe", daemon=True)
            t.start()
            started.append(t)
    except RuntimeError as err:
        if not exits.thread_refused(err):
            raise
    finally:
        go.set()
        for t in started:
            t.join()
    deadline = time.monotonic() + 1.0
    while before is not None and (task_count() or 0) > before and time.monotonic() < deadline:
        time.sleep(0.001)
    return len(started) == n


def _stop_margin(stop_timeout: float) -> float:
    """What a stop keeps of `stop_timeout` for closing the index and exiting."""
    return min(1.0, 0.25 * stop_timeout)


def _stop_write_s(stop_timeout: float) -> float:
    """The seconds a stop leaves the SSD writer for the backlog: what the
    store's close gets (stop_timeout less its margin), less the part it keeps
    for the batch in hand (SsdStore.close)."""
    left = stop_timeout - _stop_margin(stop_timeout)
    return left - min(1.0, 0.2 * left)


def _drop_plane(daemon) -> None:
    """A bind that failed after making the shared-memory plane removes it:
    its folder in /dev/shm would outlive the run (a clean stop leaves none)."""
    plane = daemon.handler.shm
    if plane is not None:
        daemon.handler.shm = None
        plane.close()


def _bind_exit(err: BaseException) -> int:
    """The exit code of a failed bind: the table's for kvd's own endpoint
    errors (busy 4, an unsafe run dir 78); 1 when the system is out of fds
    or memory (the environment's refusal, kvd.cli.exits); 4 for the rest
    libzmq reports (an address in use, ...), as before."""
    from kvd.endpoint import EndpointError

    if isinstance(err, EndpointError):
        known = exits.describe(err)
        return known[0] if known else exits.REFUSED
    code = getattr(err, "errno", None)
    if code in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        return exits.FAILED
    if code in (errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP, errno.ENOTDIR, errno.EINVAL, errno.ENAMETOOLONG):
        # A path or address that cannot be used (a folder in the socket's place,
        # a run dir that cannot be made, an address libzmq refuses): a restart
        # changes nothing, so 78, which service managers do not restart on.
        return exits.CONFIG
    return exits.REFUSED


def _remote_key(cfg, log: logging.Logger):
    """The remote tier's shared key, or exit 78 with the one line that says
    which command makes it; and a warning for a server reached in the clear."""
    from kvd.endpoint import EndpointError, read_remote_key, remote_key_path
    from kvd.store.remote.url import exposed

    path = remote_key_path(cfg.remote_key_file, cfg.keys_dir)
    try:
        auth = read_remote_key(path)
    except EndpointError as err:
        log.error("%s", err)
        raise SystemExit(exits.CONFIG)
    log.info("remote tier key %s (fingerprint %s)", path, auth.fingerprint)
    why = exposed(cfg.remote_url)
    if why:
        log.warning("remote_url %s: %s; the values are signed, but anyone on the path can read them "
                    "and fill the server: use rediss:// and a password or ACL user", BY_NAME["remote_url"].shown(cfg.remote_url), why)
    return auth


@main.command()
@config_options
def serve(**flags) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM or `kvd stop`.

    Every setting comes from (lowest first) its default, the config file,
    a KVD_* environment variable, or the flag; `kvd config` shows the result.
    Exits 4 if another daemon holds the endpoint or the data dir, 78 for a
    bad configuration, 1 if the system refuses what it needs to start (a
    thread, under a pids limit; a file descriptor).
    """
    from kvd.server.collector import Collector
    from kvd.server.daemon import Daemon
    from kvd.endpoint import EndpointError
    from kvd.server.governor import from_config as governor_for
    from kvd.host.fds import raise_fd_limit
    from kvd.host.memory import tune_malloc
    from kvd.server.admission.caps import default_max_peers, io_threads
    from kvd.server.governor import auto_ram_mb
    from kvd.service.notify import Notifier
    from kvd.store import DataDirBusy, IncompatibleIndex, open_store
    from kvd.store.tiered import with_remote
    from kvd.store.ramonly import RamOnly
    import lmdb

    # Everything the daemon creates -- run dir, socket, lock, data dir, blobs
    # -- is for its own user only (kvd.endpoint rule 5). The umask is
    # process-wide, so it is set here, first, while this is the only thread
    # (no store writer, metrics server or ZeroMQ I/O thread exists yet), and
    # never changed back and forth around a bind while other threads run.
    os.umask(0o077)
    try:
        cfg = resolve(flags)
        if cfg.write_through and cfg.data_dir is None:
            # A promise of durability with no disk to keep it: refuse, do not pretend.
            raise ConfigError("write_through needs a data_dir (it is \"none\": RAM only)")
    except ConfigError as err:
        click.echo(f"kvd: {err}", err=True)
        raise SystemExit(exits.CONFIG)
    try:
        setup_logging(cfg.log_level, cfg.log_file)
    except OSError as err:  # not ours to write (the settings table checked the rest): a setting to change
        click.echo(f"kvd: log_file {cfg.log_file}: cannot open: {err.strerror or err}", err=True)
        raise SystemExit(exits.CONFIG)
    log = logging.getLogger("kvd.server")
    select_host(cfg.host)  # before anything asks the OS for a mechanism (kvd.host.select)
    notifier = Notifier.from_env()
    notifier.status("starting: opening the store")
    # Before anything opens a file: libzmq aborts on EMFILE (kvd.server.admission.gate).
    fd_soft, fd_hard = raise_fd_limit()
    tune_malloc()  # freed message buffers leave the process (kvd.server.admission.gate rule 3)
    # The serving thread shares the GIL with the SSD writer, the peer gate and
    # the remote readers: when one of them runs Python, a request waits for
    # the GIL up to the switch interval (5 ms by default; LOOKUP p99 3-15 ms
    # while the writer walked a 1 M-entry index, 2.8-3.4 ms at 0.2 ms).
    sys.setswitchinterval(0.0002)
    max_peers = cfg.max_peers or default_max_peers(fd_soft)
    if max_peers > fd_soft - 128:  # no room left for a burst accepted before the gate pauses
        log.warning("max_peers=%d is too close to the fd limit %d: using %d", max_peers, fd_soft, fd_soft - 128)
        max_peers = max(8, fd_soft - 128)
    log.info("fd limit %d (hard %d): max_peers=%d", fd_soft, fd_hard, max_peers)
    remote_auth = _remote_key(cfg, log) if cfg.remote_url else None
    ram_mb = auto_ram_mb() if cfg.ram_mb == "auto" else cfg.ram_mb
    if cfg.ram_mb == "auto":
        log.info("ram_mb = auto: %d MiB (an eighth of the memory this daemon may use)", ram_mb)
    # "auto": the RAM tier's budget, at least 256 MiB (kvd.store.tiered.AUTO_DIRTY_MIN).
    dirty_max_mb = max(ram_mb, 256) if cfg.dirty_max_mb == "auto" else cfg.dirty_max_mb
    try:
        local = open_store(
            ram_mb * MiB,
            data_dir=cfg.data_dir,
            ssd_bytes=int(cfg.ssd_gb * GiB),
            write_through=cfg.write_through,
            min_free_bytes=int(cfg.min_free_gb * GiB),
            queue_entries=cfg.spill_queue,
            queue_bytes=dirty_max_mb * MiB,
            pack_max_bytes=cfg.pack_max_kb * 1024,
            full_fsync=cfg.full_fsync,
            max_entry_bytes=cfg.max_message_mb * MiB,  # bounds what a sane index row says (index.Row.check)
            stop_write_s=_stop_write_s(cfg.stop_timeout),  # what a stop may have to write, by time
            dirty_max_bytes=None if cfg.dirty_max_mb == "auto" else cfg.dirty_max_mb * MiB,
        )
    except (DataDirBusy, IncompatibleIndex) as err:
        log.error("cannot open data dir %s: %s", cfg.data_dir, err)
        raise SystemExit(exits.REFUSED)
    except ValueError as err:
        log.error("cannot open the store: %s", err)
        raise SystemExit(exits.CONFIG)
    except RuntimeError as err:  # its writer thread
        _refused_thread(log, err, "opening the store")
    except (OSError, lmdb.Error) as err:
        # Read-only, full, or unreadable: the disk's state, not a setting. A
        # cache that refuses to start takes every model server's cache with
        # it; RAM alone still serves. (A damaged index is not this: the SSD
        # tier moves it aside and rebuilds it, see kvd/store/ssd/heal.py.)
        reason = f"{err.strerror or err}" + (f": {err.filename}" if getattr(err, "filename", None) else "") \
            if isinstance(err, OSError) else f"index: {err}"
        log.error("data dir %s cannot be used (%s): serving from RAM only, degraded; fix it and restart kvd",
                  cfg.data_dir, reason)
        local = RamOnly(ram_mb * MiB, cfg.data_dir, reason, write_through=cfg.write_through)
    # The remote tier, if configured, stands behind the local tiers (RAM only too).
    try:
        store = with_remote(local, cfg.remote_url, dict(
            auth=remote_auth, ca_file=cfg.remote_ca_file, ttl_s=cfg.remote_ttl_s, timeout=cfg.remote_timeout_s, part_bytes=cfg.remote_part_mb * MiB,
            backlog_bytes=cfg.remote_backlog_mb * MiB, batch_entries=cfg.remote_batch,
            cluster=cfg.remote_cluster, read_replicas=cfg.remote_read_replicas,
            max_entry_bytes=cfg.max_message_mb * MiB,  # a remote header promising more is refused unread
        ))
    except ImportError as err:  # remote_url without the kvd[remote] extra
        log.error("remote_url needs the client library: pip install 'kvd[remote]' (%s)", err)
        raise SystemExit(exits.CONFIG)
    except RuntimeError as err:  # its uploader thread
        _refused_thread(log, err, "opening the remote tier", local)
    except (ValueError, OSError) as err:
        log.error("cannot open the remote tier: %s", err)
        raise SystemExit(exits.CONFIG)

    if cfg.quota:
        cfg.quota.attach(store)
    governor = governor_for(cfg, store, ram_mb * MiB)

    collector = Collector()  # the cyclic GC on our ticks (collector.py)

    def on_tick() -> None:
        collector.tick()
        notifier.tick()
        if governor is not None:
            with daemon.lock:  # the metrics thread reads the RAM tier under it
                governor.tick()

    metrics = None
    daemon = Daemon(
        store,
        cfg.endpoint,
        limits=Limits(max_message_bytes=cfg.max_message_mb * MiB),
        chunk_tokens=cfg.chunk_tokens,
        on_ready=lambda: notifier.ready(f"serving {cfg.endpoint}"),
        on_tick=on_tick,
        keys_dir=cfg.keys_dir,
        allow_insecure_tcp=cfg.allow_insecure_tcp,
        shm=cfg.shm,
        shm_lease_s=cfg.shm_lease_s,
        stop_timeout=cfg.stop_timeout,
        parked_max_bytes=dirty_max_mb * MiB,
        max_peers=max_peers,
    )
    daemon.shm_warm_bytes = cfg.shm_warm_mb * MiB  # kvd/server/shm/startup.py: the preparer's window at start
    if cfg.quota:
        daemon.handler.stats_sections["quotas"] = cfg.quota.report
    if governor is not None:
        daemon.handler.stats_sections["pressure"] = governor.stats
        # Spilling is what relieves it: the SSD writer does not rest for reads meanwhile.
        daemon.pressed = lambda: governor.level != "normal" or governor.target < governor.max_bytes
    daemon.handler.stats_sections["gc"] = lambda stats: collector.stats()
    daemon.handler.stats_sections["host"] = lambda stats: host_mechanisms()
    if not _threads_fit(_threads_bind_starts(cfg.endpoint, io_threads())):
        _refused_thread(log, RuntimeError("can't start new thread"), "starting ZeroMQ", store)
    try:
        daemon.bind()
    except (EndpointError, Exception) as err:  # zmq.ZMQError: address in use, permission, ...
        _drop_plane(daemon)
        if exits.thread_refused(err):
            _refused_thread(log, err, f"binding {cfg.endpoint}", store)
        log.error("cannot serve %s: %s", cfg.endpoint, err)
        store.close()
        raise SystemExit(_bind_exit(err))
    if cfg.metrics_port:
        from kvd.server.metrics import serve_metrics

        try:
            metrics = serve_metrics(daemon, cfg.metrics_port, idle_s=cfg.metrics_idle_s)
        except RuntimeError as err:  # its thread
            daemon.close()
            _refused_thread(log, err, "starting the metrics exporter", store)
        except OSError as err:
            # Taken, or not ours to bind: a setting to change, not a crash to
            # restart (78). Let go of what a stop lets go of -- the endpoint,
            # its lock, the store -- so the next start finds them free.
            log.error("cannot serve metrics on 127.0.0.1:%d (metrics_port): %s", cfg.metrics_port, err.strerror or err)
            daemon.close()
            store.close()
            raise SystemExit(exits.CONFIG)
    daemon.install_signal_handlers()
    log.info(
        "ready endpoint=%s ram_mb=%d data_dir=%s ssd_gb=%g write_through=%s max_message_mb=%d chunk_tokens=%d "
        "metrics_port=%d pressure_source=%s remote_url=%s",
        cfg.endpoint, ram_mb, cfg.data_dir or "none", cfg.ssd_gb, cfg.write_through,
        cfg.max_message_mb, cfg.chunk_tokens, cfg.metrics_port, cfg.pressure_source,
        BY_NAME["remote_url"].shown(cfg.remote_url) or "none",
    )
    if cfg.gc_on_tick:
        collector.start()
    try:
        daemon.serve_forever()
    finally:
        notifier.stopping("flushing the store")
        if metrics is not None:
            metrics.shutdown()
        # Whatever the RAM tier holds, the stop ends within stop_timeout: the
        # writer gets what is left of it, less a margin for closing the index
        # and exiting; what it has not written by then is logged (ssd.py).
        since = daemon.stopping_since if daemon.stopping_since is not None else time.monotonic()
        left = max(0.0, cfg.stop_timeout - _stop_margin(cfg.stop_timeout) - (time.monotonic() - since))
        store.close(timeout=left)
        notifier.close()
    log.info("stopped")
    # Everything is written, closed and logged. Tearing the interpreter down
    # would free the RAM tier object by object -- seconds for a large tier,
    # outside stop_timeout -- for nothing: the kernel takes it back at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
