"""`kvd serve`: run the daemon in the foreground."""

from __future__ import annotations

import logging
import os
import sys

import click

from kvd.cli import exits, main
from kvd.config import EXIT_CONFIG, ConfigError, config_options, resolve
from kvd.protocol.limits import MiB, Limits

GiB = 1 << 30
LOG_FORMAT = "%(asctime)s kvd[%(process)d] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, log_file: str | None = None) -> None:
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@main.command()
@config_options
def serve(**flags) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM or `kvd stop`.

    Every setting comes from (lowest first) its default, the config file,
    a KVD_* environment variable, or the flag; `kvd config` shows the result.
    Exits 4 if another daemon holds the endpoint or the data dir, 78 for a
    bad configuration.
    """
    from kvd.server.daemon import Daemon
    from kvd.endpoint import EndpointError
    from kvd.server.governor import from_config as governor_for
    from kvd.server.peers import default_max_peers, raise_fd_limit, tune_malloc
    from kvd.server.pressure import auto_ram_mb
    from kvd.service.notify import Notifier
    from kvd.store import DataDirBusy, IncompatibleIndex, open_store

    # Everything the daemon creates -- run dir, socket, lock, data dir, blobs
    # -- is for its own user only (kvd.endpoint rule 5). The umask is
    # process-wide, so it is set here, first, while this is the only thread
    # (no store writer, metrics server or ZeroMQ I/O thread exists yet), and
    # never changed back and forth around a bind while other threads run.
    os.umask(0o077)
    try:
        cfg = resolve(flags)
    except ConfigError as err:
        click.echo(f"kvd: {err}", err=True)
        raise SystemExit(EXIT_CONFIG)
    setup_logging(cfg.log_level, cfg.log_file)
    log = logging.getLogger("kvd.server")
    notifier = Notifier.from_env()
    notifier.status("starting: opening the store")
    # Before anything opens a file: libzmq aborts on EMFILE (kvd.server.peers).
    fd_soft, fd_hard = raise_fd_limit()
    tune_malloc()  # freed message buffers leave the process (kvd.server.peers rule 3)
    max_peers = cfg.max_peers or default_max_peers(fd_soft)
    if max_peers > fd_soft - 128:  # no room left for a burst accepted before the gate pauses
        log.warning("max_peers=%d is too close to the fd limit %d: using %d", max_peers, fd_soft, fd_soft - 128)
        max_peers = max(8, fd_soft - 128)
    log.info("fd limit %d (hard %d): max_peers=%d", fd_soft, fd_hard, max_peers)
    ram_mb = auto_ram_mb() if cfg.ram_mb == "auto" else cfg.ram_mb
    if cfg.ram_mb == "auto":
        log.info("ram_mb = auto: %d MiB (an eighth of the memory this daemon may use)", ram_mb)
    try:
        store = open_store(
            ram_mb * MiB,
            data_dir=cfg.data_dir,
            ssd_bytes=int(cfg.ssd_gb * GiB),
            write_through=cfg.write_through,
            min_free_bytes=int(cfg.min_free_gb * GiB),
            queue_entries=cfg.spill_queue,
        )
    except (DataDirBusy, IncompatibleIndex) as err:
        log.error("cannot open data dir %s: %s", cfg.data_dir, err)
        raise SystemExit(exits.REFUSED)
    except (ValueError, OSError) as err:
        log.error("cannot open the store: %s", err)
        raise SystemExit(EXIT_CONFIG if isinstance(err, ValueError) else exits.FAILED)

    if cfg.quota:
        cfg.quota.attach(store)
    governor = governor_for(cfg, store, ram_mb * MiB)

    def on_tick() -> None:
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
        max_peers=max_peers,
    )
    if cfg.quota:
        daemon.handler.stats_sections["quotas"] = cfg.quota.report
    if governor is not None:
        daemon.handler.stats_sections["pressure"] = governor.stats
    try:
        daemon.bind()
    except (EndpointError, Exception) as err:  # zmq.ZMQError: address in use, permission, ...
        log.error("cannot serve %s: %s", cfg.endpoint, err)
        store.close()
        # The exit code comes from the one table: busy is 4, an unsafe run dir 78.
        known = exits.describe(err) if isinstance(err, EndpointError) else None
        raise SystemExit(known[0] if known else exits.REFUSED)
    if cfg.metrics_port:
        from kvd.server.metrics import serve_metrics

        metrics = serve_metrics(daemon, cfg.metrics_port)
    daemon.install_signal_handlers()
    log.info(
        "ready endpoint=%s ram_mb=%d data_dir=%s ssd_gb=%g write_through=%s max_message_mb=%d chunk_tokens=%d "
        "metrics_port=%d pressure_source=%s",
        cfg.endpoint, ram_mb, cfg.data_dir or "none", cfg.ssd_gb, cfg.write_through,
        cfg.max_message_mb, cfg.chunk_tokens, cfg.metrics_port, cfg.pressure_source,
    )
    try:
        daemon.serve_forever()
    finally:
        notifier.stopping("flushing the store")
        if metrics is not None:
            metrics.shutdown()
        store.close()
        notifier.close()
    log.info("stopped")
