"""The systemd user unit that runs `kvd serve`.

The unit text lives here (not only in systemd/kvd.service) so an installed
wheel can render it; systemd/kvd.service in the repository is this template
rendered for EXAMPLE_PYTHON, and a test keeps the two identical.
"""

from __future__ import annotations

import math
import os
from pathlib import PurePosixPath
from typing import Mapping, Sequence

UNIT_NAME = "kvd.service"
EXAMPLE_PYTHON = "/usr/bin/python3"
# The default of kvd's `stop_timeout` setting (kvd/config.py; a test keeps the
# two equal: kvd.service may not import kvd.config), and the margin above it
# the service managers get before they SIGKILL.
DEFAULT_STOP_TIMEOUT = 10.0
STOP_MARGIN = 5

UNIT_TEMPLATE = """\
# kvd.service: a systemd *user* unit for the kvd KV-cache daemon.
#
# `kvd service install` writes this file to ~/.config/systemd/user/kvd.service
# with ExecStart= set to the Python that kvd is installed into, then runs
# `systemctl --user daemon-reload` and `systemctl --user enable --now kvd`.
#
# To install it by hand instead, _at the very least_ adapt:
#   - ExecStart=: the absolute path of the Python whose environment has kvd
#     (a virtualenv's bin/python; %h stands for your home folder);
#   - the tier sizes: add --ram-mb / --ssd-gb to ExecStart=, or set them in
#     ~/.config/kvd/kvd.toml (`kvd config` shows what is in effect and why).
# then run: systemctl --user daemon-reload && systemctl --user enable --now kvd
# To keep kvd running while you are logged out: loginctl enable-linger $USER
#
# The socket is $XDG_RUNTIME_DIR/kvd/kvd.sock (%t) and the SSD tier lives in
# ~/.cache/kvd (%C): systemd creates both folders for the daemon. Flags on
# ExecStart= take precedence over the config file and the environment.
#
# Hardening is on, limited to what a user manager can enforce without user
# namespaces; the rest is commented out below with the reason. See
# systemd.service(5), systemd.exec(5) and systemd/README.md for more.

[Unit]
Description=kvd KV-cache daemon for MLX inference servers
#Before=your-inference-server.service

[Service]
Type=notify
ExecStart=@PYTHON@ -m kvd serve --endpoint ipc://%t/kvd/kvd.sock --data-dir %C/kvd@EXTRA@
## Alternatively, take everything but the socket from a config file:
#ExecStart=@PYTHON@ -m kvd serve --endpoint ipc://%t/kvd/kvd.sock --config %E/kvd/kvd.toml
Restart=on-failure
RestartSec=2
# Exit status 78 (EX_CONFIG) is a bad configuration: restarting cannot fix it.
RestartPreventExitStatus=78
# kvd sends WATCHDOG=1 from its main loop; if the loop wedges, systemd kills
# and restarts it after this long.
WatchdogSec=30
TimeoutStartSec=90
# After SIGTERM kvd writes what is not yet on disk for at most its
# stop_timeout (10 s by default), logs what it had to leave, and exits 0.
# This is that plus a margin; `kvd service install` sets it from the
# stop_timeout in effect. Raise both together.
TimeoutStopSec=@STOP@
RuntimeDirectory=kvd
RuntimeDirectoryMode=0700
CacheDirectory=kvd
CacheDirectoryMode=0700
UMask=0077
Environment=PYTHONUNBUFFERED=1
# Huge pages for big buffers: ipc throughput went from ~1 to ~3 GiB/s on x86-64.
#Environment=GLIBC_TUNABLES=glibc.malloc.hugetlb=1
# Memory cap for the whole daemon (RAM tier plus buffers in flight).
#MemoryMax=8G
#LimitNOFILE=65536

# Hardening enforced by seccomp and prctl: works in any user manager.
NoNewPrivileges=yes
LockPersonality=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
RestrictNamespaces=yes
# Safe: numpy, pyzmq, lmdb and xxhash never map memory writable and executable
# (tests/service/test_service_systemd.py checks), and the daemon never imports mlx.
MemoryDenyWriteExecute=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM
# ipc endpoints need AF_UNIX; tcp endpoints and the metrics port need
# AF_INET/AF_INET6 (add AF_NETLINK to bind tcp endpoints by interface name).
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6

# These need mount or user namespaces: a user manager turns on PrivateUsers=
# for them, and where unprivileged user namespaces are off or restricted
# (hardened kernels, Ubuntu 24.04's AppArmor default, containers) the unit then
# fails with status 226/NAMESPACE. Check first, then uncomment:
#   systemd-run --user --wait -p PrivateTmp=yes true
#PrivateTmp=yes
#PrivateDevices=yes
#ProtectSystem=strict
#ProtectHome=read-only
#ProtectKernelTunables=yes
#ProtectKernelModules=yes
#ProtectKernelLogs=yes
#ProtectControlGroups=yes
#ProtectHostname=yes
#ProtectClock=yes
# Only with an ipc endpoint and no metrics port:
#PrivateNetwork=yes

[Install]
WantedBy=default.target
"""


def check_arg(arg: str) -> None:
    """Raise ValueError if `arg` cannot be one word of a service's command
    line: a control character (a newline would end ExecStart= and start a
    line of the unit's own), or text that is not UTF-8 (a unit file is)."""
    bad = next((c for c in arg if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(f"holds a control character ({bad!r}), which a service's command line cannot carry")
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:  # bytes that were not UTF-8, carried in by surrogateescape
        raise ValueError("is not UTF-8, which a service file must be") from None


def _exec_arg(arg: str) -> str:
    """Quote one ExecStart= word (systemd.service(5), "Command lines").

    `%` starts a specifier and `$` a variable (`$VAR`, `${VAR}`), inside
    quotes too: each is doubled to stand for itself. Spaces split words and
    `\\` escapes, so a word holding either, a quote or `;` is double-quoted.
    Raises ValueError (check_arg) for what no quoting can carry."""
    check_arg(arg)
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg == "" or any(c in arg for c in " \t\"'\\;$"):
        arg = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def stop_grace(stop_timeout: float = DEFAULT_STOP_TIMEOUT) -> int:
    """Seconds a service manager should wait after SIGTERM before SIGKILL:
    kvd's own bound, `stop_timeout`, plus a margin for a loaded machine."""
    return math.ceil(stop_timeout) + STOP_MARGIN


def render_unit(
    python: str | os.PathLike = EXAMPLE_PYTHON, extra_args: Sequence[str] = (), stop_timeout: float = DEFAULT_STOP_TIMEOUT
) -> str:
    """Return the unit file text whose ExecStart= runs `python -m kvd serve`,
    with `extra_args` appended to the serve command, and TimeoutStopSec= a
    little above `stop_timeout` (the daemon's setting of that name).

    Raises ValueError if `python` is not an absolute path.
    """
    python = os.fspath(python)
    if not python.startswith("/"):
        raise ValueError(f"python must be an absolute path, got {python!r}")
    extra = "".join(" " + _exec_arg(str(a)) for a in extra_args)
    # @STOP@ first: an argument may hold those characters itself.
    text = UNIT_TEMPLATE.replace("@STOP@", str(stop_grace(stop_timeout)))
    return text.replace("@PYTHON@", _exec_arg(python)).replace("@EXTRA@", extra)


def unit_path(home: str | os.PathLike, environ: Mapping[str, str] | None = None) -> PurePosixPath:
    """Return where the user unit is installed: $XDG_CONFIG_HOME/systemd/user/kvd.service
    (default ~/.config/systemd/user/kvd.service)."""
    environ = {} if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or ""
    root = PurePosixPath(base) if base.startswith("/") else PurePosixPath(os.fspath(home)) / ".config"
    return root / "systemd" / "user" / UNIT_NAME


if __name__ == "__main__":  # python -m kvd.service.systemd > systemd/kvd.service
    print(render_unit(EXAMPLE_PYTHON), end="")
