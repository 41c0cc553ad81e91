"""`kvd service install|uninstall|status`: run kvd as a per-user service.

launchd on macOS (~/Library/LaunchAgents/io.kvd.daemon.plist), a systemd user
unit on Linux (~/.config/systemd/user/kvd.service). Exit codes: 0 done (status:
the daemon answers), 1 a launchctl/systemctl command failed or this OS is not
supported, 2 bad usage (a SERVE_ARG with a control character, or not UTF-8),
3 (status) no daemon answers, 78 bad configuration.
"""

from __future__ import annotations

import click

from kvd.cli import exits, main
from kvd.cli.common import settings
from kvd.config import ConfigError, config_options, resolve
from kvd.service import install as svc

_init_option = click.option(
    "--init", type=click.Choice(svc.INIT_SYSTEMS), default=None,
    help="Init system to target [default: launchd on macOS, systemd on Linux].",
)
_dry_run_option = click.option(
    "--dry-run", is_flag=True, help="Print the file and the commands instead of changing anything.",
)


def _target(init: str | None) -> svc.Target:
    try:
        return svc.Target.current(init)
    except svc.ServiceError as exc:
        click.echo(f"kvd service: {exc}", err=True)
        raise SystemExit(exc.exit_code)


def _carry_out(plan: svc.Plan, dry_run: bool) -> None:
    if dry_run:
        click.echo(plan.describe(), nl=False)
        return
    try:
        svc.apply(plan)
    except svc.ServiceError as exc:
        click.echo(f"kvd service {plan.action}: {exc}", err=True)
        raise SystemExit(exc.exit_code)
    except OSError as exc:
        click.echo(f"kvd service {plan.action}: {exc}", err=True)
        raise SystemExit(svc.EXIT_FAILED)
    verb = "installed and started" if plan.action == "install" else "stopped and removed"
    note = svc.mode_note(plan.mode) if plan.content is not None else ""
    click.echo(f"kvd service {verb}: {plan.path}{note}")


@main.group()
def service() -> None:
    """Run kvd as a per-user service (launchd on macOS, systemd on Linux)."""


@service.command("install")
@_dry_run_option
@_init_option
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED)
def install_cmd(dry_run: bool, init: str | None, serve_args: tuple[str, ...]) -> None:
    """Install and start the service for this user and this Python.

    SERVE_ARGS after `--` are added to `kvd serve`, e.g.
    `kvd service install -- --ram-mb 8192`. Re-installing replaces the file
    and restarts a running daemon.
    """
    try:
        svc.check_serve_args(serve_args)  # before anything reads them (a unit file is UTF-8, line by line)
    except ValueError as exc:
        click.echo(f"kvd service install: {exc}", err=True)
        raise SystemExit(svc.EXIT_USAGE)
    target, stop_timeout = _target(init), _stop_timeout(serve_args)
    try:
        plan = svc.install_plan(target, serve_args, stop_timeout=stop_timeout)
    except ValueError as exc:  # what no unit or plist can hold (a home folder with control characters)
        click.echo(f"kvd service install: {exc}", err=True)
        raise SystemExit(exits.CONFIG)
    _carry_out(plan, dry_run)


def _stop_timeout(serve_args: tuple[str, ...]) -> float:
    """The stop_timeout the service's daemon will run with: a --stop-timeout
    among SERVE_ARGS, else the config file's, else the default. The unit or
    plist gives the daemon a little more than that before it kills it."""
    flags: dict[str, str] = {}
    for i, arg in enumerate(serve_args):
        for flag, name in (("--stop-timeout", "stop_timeout"), ("--config", "config")):
            if arg == flag and i + 1 < len(serve_args):
                flags[name] = serve_args[i + 1]
            elif arg.startswith(flag + "="):
                flags[name] = arg.split("=", 1)[1]
    try:
        return resolve(flags).stop_timeout  # (a --config among them: its file's, as the daemon will read it)
    except ConfigError as err:
        click.echo(f"kvd service: {err}", err=True)
        raise SystemExit(exits.CONFIG)


@service.command("uninstall")
@_dry_run_option
@_init_option
def uninstall_cmd(dry_run: bool, init: str | None) -> None:
    """Stop the service and remove its file (succeeds if it is not installed)."""
    _carry_out(svc.uninstall_plan(_target(init)), dry_run)


@service.command("status")
@_init_option
@config_options(names=("endpoint",))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
def status_cmd(init: str | None, as_json: bool, **flags) -> None:
    """Say whether the service is installed, loaded, and answering a ping.

    The endpoint pinged is the one set by --endpoint, KVD_ENDPOINT or the
    config file; with none set, the installed service's. Exits 0 if a
    daemon answers, 3 if none does.
    """
    t = _target(init)
    cfg = settings(flags)
    endpoint = cfg.endpoint
    if cfg.sources["endpoint"] == "default":
        endpoint = svc.service_endpoint(t) or endpoint
    st = svc.status(t, endpoint)
    click.echo(st.to_json() if as_json else st.describe(), nl=as_json)
    raise SystemExit(st.exit_code)
