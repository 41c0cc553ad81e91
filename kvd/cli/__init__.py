"""The `kvd` command line: one click group, one module per command family.

Shared plumbing (settings options, the admin client, the data dir an offline
command reads, size formatting) lives in `kvd.cli.common`; exit codes and the
error -> exit code table in `kvd.cli.exits`. Commands import from those two,
never from each other.

A command's module is imported when that command runs (`COMMANDS`, below):
`kvd serve` does not load `kvd doctor`, `kvd top` or the service installer
(~30 ms sooner at every start: a restart under launchd or systemd, every
daemon the tests start), and `kvd stats` ~0.1 s sooner. `kvd --help` imports
them all to list them.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from kvd import __version__
from kvd.cli import exits


def _numpy_with_one_blas_thread() -> None:
    """numpy loaded, before any command imports it, with OpenBLAS at one
    thread. numpy's Linux wheels bundle OpenBLAS, which starts a thread per
    core at load and spins them ~0.1 s waiting for work that kvd never gives
    (no command does linear algebra): measured here, `import numpy` took
    0.18-0.22 s of CPU for 0.12-0.15 s of wall time, against 0.11-0.13 s with
    one thread -- at every daemon start and every `kvd` command. The variable
    is set for the load only: processes this one starts (`kvd service`'s
    managers, none of them BLAS users either) see the environment it was
    given. A user's own OPENBLAS_NUM_THREADS wins; macOS wheels use Accelerate."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    except ImportError:  # (a broken install says so where it is used)
        pass
    finally:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)


_numpy_with_one_blas_thread()


# Each command (or group) and the module that defines it with `@main.command`.
COMMANDS = {
    "config": "config_cmd", "doctor": "doctor", "explain": "explain", "export": "transfer", "gc": "admin",
    "import": "transfer", "keys": "keys_cmd", "ls": "inspect", "serve": "serve", "service": "service_cmd",
    "stats": "admin", "stop": "admin", "top": "top", "verify": "inspect",
}


class _Kvd(click.Group):
    """A click group that turns every error `exits.describe` knows into one
    line on stderr and its exit code (no traceback for a user mistake or a
    fault of the environment), and imports a command's module only when the
    command is asked for (`COMMANDS`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMANDS.get(name)
        if module is not None and name not in self.commands:
            importlib.import_module(f"kvd.cli.{module}")  # registers its commands on `main`
        return super().get_command(ctx, name)

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

