"""The `kvd` command line: one click group, one module per command family."""

from __future__ import annotations

import click

from kvd import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvd")
def main() -> None:
    """kvd: a KV-cache daemon for MLX inference servers.

    Run `kvd serve` to start the daemon; the other commands talk to it.
    """


def _register() -> None:
    # Imported here so each module can `from kvd.cli import main` if it needs to.
    from kvd.cli import admin, config_cmd, explain, inspect, serve, service_cmd, top, transfer  # noqa: F401


_register()
