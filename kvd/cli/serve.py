"""`kvd serve`: run the daemon in the foreground."""

from __future__ import annotations

import logging
import sys

import click

from kvd.cli import exits, main
from kvd.protocol.limits import MiB, Limits
from kvd.server.endpoint import EndpointError, default_endpoint

LOG_FORMAT = "%(asctime)s kvd[%(process)d] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, log_file: str | None = None) -> None:
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@main.command()
@click.option("--endpoint", envvar="KVD_ENDPOINT", default=None, help="ZeroMQ endpoint to bind [default: per-user ipc socket].")
@click.option("--ram-mb", envvar="KVD_RAM_MB", type=click.IntRange(min=1), default=1024, show_default=True, help="RAM tier budget in MiB.")
@click.option("--max-message-mb", envvar="KVD_MAX_MESSAGE_MB", type=click.IntRange(min=1), default=512, show_default=True, help="Largest message accepted, in MiB.")
@click.option("--chunk-tokens", envvar="KVD_CHUNK_TOKENS", type=click.IntRange(min=1), default=256, show_default=True, help="Chunk size advertised to clients.")
@click.option("--log-level", envvar="KVD_LOG_LEVEL", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def serve(endpoint, ram_mb, max_message_mb, chunk_tokens, log_level) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM or `kvd stop`.

    Exits 4 if another daemon already serves the endpoint.
    """
    from kvd.server.daemon import Daemon
    from kvd.store.ram import RamStore

    setup_logging(log_level)
    log = logging.getLogger("kvd.server")
    endpoint = endpoint or default_endpoint()
    store = RamStore(ram_mb * MiB)
    limits = Limits(max_message_bytes=max_message_mb * MiB)
    daemon = Daemon(store, endpoint, limits=limits, chunk_tokens=chunk_tokens)
    try:
        daemon.bind()
    except EndpointError as err:
        log.error("%s", err)
        raise SystemExit(exits.REFUSED)
    except Exception as err:  # zmq.ZMQError: address in use, permission, ...
        log.error("cannot bind %s: %s", endpoint, err)
        raise SystemExit(exits.REFUSED)
    daemon.install_signal_handlers()
    log.info("ready endpoint=%s ram_mb=%d max_message_mb=%d chunk_tokens=%d", endpoint, ram_mb, max_message_mb, chunk_tokens)
    try:
        daemon.serve_forever()
    finally:
        store.close()
    log.info("stopped")
