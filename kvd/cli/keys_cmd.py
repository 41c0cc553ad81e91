"""`kvd keys`: the CURVE key files a tcp:// endpoint needs (kvd.endpoint rule 6).

    kvd keys init              the daemon's key pair (once per keys dir)
    kvd keys add-client NAME   a client pair for NAME, its public key authorized
    kvd keys remote            the remote tier's shared key (remote.key)
    kvd keys ls                what the keys dir holds

Files are created 0600 in a 0700 keys dir (the `keys_dir` setting); nothing
is ever overwritten. To let a client on another machine in, copy
`clients/NAME.key_secret` and `server.key` into that user's keys dir. The
daemon reads `authorized/` when it starts: restart it after add-client.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from kvd.cli import exits, main
from kvd.cli.common import fail, settings
from kvd.config import config_options

_keys_options = config_options(names=("keys_dir",))
_remote_options = config_options(names=("keys_dir", "remote_key_file"))


def _keys_dir(flags) -> Path:
    from kvd.endpoint import default_keys_dir, ensure_keys_dir

    cfg = settings(flags)
    return ensure_keys_dir(Path(cfg.keys_dir) if cfg.keys_dir else default_keys_dir())


def _write_pair(secret_path: Path, public_path: Path, taken: str) -> bytes:
    """Make a CURVE key pair and write it as `secret_path` (both keys) and
    `public_path` (the public one); return the public key. Exits REFUSED,
    with `taken` after the path, if either file exists: keys are never
    overwritten."""
    import zmq

    from kvd.endpoint import write_cert

    for path in (secret_path, public_path):
        if os.path.lexists(path):
            fail(exits.REFUSED, f"{path} exists: {taken}")
    public, secret = zmq.curve_keypair()
    write_cert(secret_path, public, secret)
    write_cert(public_path, public, None)
    return public


@main.group()
def keys() -> None:
    """CURVE keys for serving and reaching a tcp:// endpoint."""


@keys.command("init")
@_keys_options
def init(**flags) -> None:
    """Make the daemon's key pair (server.key_secret, server.key)."""
    from kvd.endpoint import SERVER_CERT

    d = _keys_dir(flags)
    secret_path, public_path = d / f"{SERVER_CERT}.key_secret", d / f"{SERVER_CERT}.key"
    public = _write_pair(secret_path, public_path, "the daemon already has a key pair")
    click.echo(f"server key pair: {secret_path}\nserver public key: {public_path} ({public.decode()})")


@keys.command("add-client")
@click.argument("name")
@_keys_options
def add_client(name: str, **flags) -> None:
    """Make a client pair NAME for this user and authorize its public key."""
    from kvd.endpoint import AUTHORIZED_DIR, CLIENTS_DIR

    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or name.startswith("."):
        fail(exits.USAGE, f"client name {name!r}: use letters, digits, '-', '_' and '.'")
    d = _keys_dir(flags)
    pair, allowed = d / CLIENTS_DIR / f"{name}.key_secret", d / AUTHORIZED_DIR / f"{name}.key"
    public = _write_pair(pair, allowed, f"client {name!r} already has keys")
    click.echo(f"client key pair: {pair}\nauthorized: {allowed} ({public.decode()})\nrestart the daemon to admit it")


@keys.command("remote")
@_remote_options
def remote(**flags) -> None:
    """Make the remote tier's shared key (remote_key_file, else remote.key in the
    keys dir): 32 random bytes every daemon sharing the tier signs and checks its
    values with. Copy the file (mode 0600) to each of them; never to the server."""
    from kvd.endpoint import remote_key_path, write_remote_key

    cfg = settings(flags)
    if cfg.remote_key_file:
        path = remote_key_path(cfg.remote_key_file, None)
    else:
        path = remote_key_path(None, str(_keys_dir(flags)))
    if os.path.lexists(path):
        fail(exits.REFUSED, f"{path} exists: the remote tier already has a key (copy that one to every daemon)")
    try:
        fingerprint = write_remote_key(path)
    except OSError as err:
        fail(exits.REFUSED, f"cannot write {path}: {err.strerror or err}")
    click.echo(f"remote key: {path} (fingerprint {fingerprint})\n"
               "copy it, mode 0600, to every daemon that shares the remote tier; `kvd stats` shows each one's fingerprint")


@keys.command("ls")
@_keys_options
def ls(**flags) -> None:
    """List the server key, the authorized client keys and this user's client pairs."""
    from kvd.endpoint import AUTHORIZED_DIR, CLIENTS_DIR, SERVER_CERT, read_cert

    d = _keys_dir(flags)
    server = d / f"{SERVER_CERT}.key"
    click.echo(f"keys dir {d}")
    click.echo(f"server: {read_cert(server)[0].decode() if os.path.lexists(server) else 'none (run `kvd keys init`)'}")
    for title, sub, ext in (("authorized", AUTHORIZED_DIR, ".key"), ("client pairs", CLIENTS_DIR, ".key_secret")):
        entries = sorted((d / sub).glob(f"*{ext}"))
        click.echo(f"{title}: {len(entries)}")
        for path in entries:
            click.echo(f"  {path.name[: -len(ext)]:<20} {read_cert(path)[0].decode()}")
