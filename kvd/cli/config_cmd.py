"""`kvd config`: show the effective settings and where each one came from."""

from __future__ import annotations

import json

import click

from kvd.cli import exits, main
from kvd.config import SETTINGS, ConfigError, config_options, resolve


def _toml_value(value: object) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value)


@main.command("config")
@config_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts) instead of TOML.")
def config_cmd(as_json: bool, **flags: object) -> None:
    """Print the effective configuration and where each value came from.

    Sources, lowest precedence first: default, config file, environment
    (KVD_<NAME>), command-line flag. The text output is valid TOML and can be
    saved as a config file. Exits 78 if a value or the config file is bad.
    """
    try:
        cfg = resolve(flags)
    except ConfigError as exc:
        click.echo(f"kvd config: {exc}", err=True)
        raise SystemExit(exits.CONFIG)
    if as_json:
        out = {
            "config_file": None if cfg.config_path is None else str(cfg.config_path),
            "settings": {
                s.name: {
                    "value": s.shown(getattr(cfg, s.name)),
                    "source": cfg.sources[s.name],
                    "env": s.env,
                    "flag": s.flag,
                    "doc": s.doc,
                }
                for s in SETTINGS
            },
            "quota": cfg.quota.to_table(),
        }
        click.echo(json.dumps(out, indent=2))
        return
    where = cfg.config_path if cfg.config_path is not None else "none found"
    click.echo(f"# kvd configuration (config file: {where})")
    lines = [(f"{s.name} = {_toml_value(s.shown(getattr(cfg, s.name)))}", cfg.sources[s.name]) for s in SETTINGS]
    width = max(len(text) for text, _ in lines)
    for text, source in lines:
        click.echo(f"{text.ljust(width)}  # {source}")
    for pattern, limits in cfg.quota.to_table().items():
        click.echo(f"\n[quota.{json.dumps(pattern)}]")
        for key, value in limits.items():
            click.echo(f"{key} = {value!r}")
