"""The `kvd` command line: one click group, one module per command family.

Shared plumbing (settings options, the admin client, the data dir an offline
command reads, size formatting) lives in `kvd.cli.common`; exit codes and the
error -> exit code table in `kvd.cli.exits`. Commands import from those two,
never from each other.
"""

from __future__ import annotations

import click

from kvd import __version__
from kvd.cli import exits


class _Kvd(click.Group):
    """A click group that turns every error `exits.describe` knows into one
    line on stderr and its exit code (no traceback for a user mistake or a
    fault of the environment)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Exception as err:
            known = exits.describe(err)
            if known is None:
                raise
            from kvd.cli.common import printable  # (common imports this package)

            code, line = known
            click.echo(f"kvd: {printable(line)}", err=True)
            ctx.exit(code)


@click.group(cls=_Kvd, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvd")
def main() -> None:
    """kvd: a KV-cache daemon for MLX inference servers.

    Run `kvd serve` to start the daemon; the other commands talk to it.
    Exit codes: 0 ok, 1 failed, 2 usage, 3 no daemon answering, 4 refused
    (a daemon error, or the endpoint or data dir is held), 78 bad configuration.
    """


def _register() -> None:
    # Imported here so each module can `from kvd.cli import main` if it needs to.
    from kvd.cli import admin, config_cmd, doctor, explain, inspect, keys_cmd, serve, service_cmd, top, transfer  # noqa: F401


_register()
