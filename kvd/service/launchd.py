"""The launchd agent that runs `kvd serve` for one macOS user.

The plist is built as data and written by plistlib, so it is always well
formed. What each key is for:

- `ProgramArguments`: the interpreter kvd was installed into, `-m kvd serve`.
  No shell, so no quoting and no login-profile surprises.
- `KeepAlive` {"SuccessfulExit": false}: restart after a crash or a non-zero
  exit, but not after a clean stop (exit 0).
- `ProcessType` "Interactive": without it launchd treats the agent as
  background work and throttles its CPU and I/O, which a cache serving an
  inference server cannot afford.
- `Umask` 0o077: the socket, logs and data are for this user only.
- `ExitTimeOut`: kvd's `stop_timeout` plus a margin; kvd itself ends a stop
  within `stop_timeout` whatever its RAM tier holds.
- Logs go to ~/Library/Logs/kvd/, where Console.app looks.
"""

from __future__ import annotations

import os
import plistlib
from pathlib import PurePosixPath
from typing import Sequence

from kvd.service.systemd import DEFAULT_STOP_TIMEOUT, stop_grace

LABEL = "io.kvd.daemon"
# launchd starts agents with a minimal PATH; this is the macOS default.
DEFAULT_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
# Seconds between SIGTERM and SIGKILL on stop: kvd's stop_timeout plus a margin
# (kvd.service.systemd.stop_grace); launchd's own default, 20 s, is not enough
# for a large stop_timeout, so it is always set.
# The paths launchd/io.kvd.daemon.plist in the repository is rendered for.
EXAMPLE_HOME = "/Users/you"
EXAMPLE_PYTHON = "/Users/you/.venvs/kvd/bin/python"


def plist_path(home: str | os.PathLike, label: str = LABEL) -> PurePosixPath:
    """Return where the agent's plist is installed: ~/Library/LaunchAgents/<label>.plist."""
    return PurePosixPath(os.fspath(home)) / "Library" / "LaunchAgents" / f"{label}.plist"


def log_dir(home: str | os.PathLike) -> PurePosixPath:
    """Return the agent's log folder, ~/Library/Logs/kvd."""
    return PurePosixPath(os.fspath(home)) / "Library" / "Logs" / "kvd"


def plist_dict(
    *, home: str | os.PathLike, python: str | os.PathLike, label: str = LABEL, extra_args: Sequence[str] = (),
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
) -> dict:
    """Return the agent definition as a dict (what `render_plist` serializes).

    Raises ValueError if `home` or `python` is not an absolute path.
    """
    home, python = os.fspath(home), os.fspath(python)
    for what, path in (("home", home), ("python", python)):
        if not path.startswith("/"):
            raise ValueError(f"{what} must be an absolute path, got {path!r}")
    logs = log_dir(home)
    bin_dir = str(PurePosixPath(python).parent)
    return {
        "Label": label,
        "ProgramArguments": [python, "-m", "kvd", "serve", *map(str, extra_args)],
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ProcessType": "Interactive",
        "Umask": 0o077,
        "ExitTimeOut": stop_grace(stop_timeout),
        "WorkingDirectory": home,
        "StandardOutPath": str(logs / "kvd.out.log"),
        "StandardErrorPath": str(logs / "kvd.err.log"),
        "EnvironmentVariables": {
            # The interpreter's folder first, so tools of the same install win.
            "PATH": f"{bin_dir}:{DEFAULT_PATH}",
            # Log lines reach the files as they happen, not when a buffer fills.
            "PYTHONUNBUFFERED": "1",
        },
    }


def render_plist(
    *, home: str | os.PathLike, python: str | os.PathLike, label: str = LABEL, extra_args: Sequence[str] = (),
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
) -> bytes:
    """Return the agent's plist (XML) for this home folder and interpreter.

    Raises ValueError if `home` or `python` is not an absolute path.
    """
    return plistlib.dumps(
        plist_dict(home=home, python=python, label=label, extra_args=extra_args, stop_timeout=stop_timeout),
        fmt=plistlib.FMT_XML,
        sort_keys=False,
    )


if __name__ == "__main__":  # python -m kvd.service.launchd > launchd/io.kvd.daemon.plist
    import sys

    sys.stdout.buffer.write(render_plist(home=EXAMPLE_HOME, python=EXAMPLE_PYTHON))


def parse_print(text: str) -> dict[str, str]:
    """The top-level `key = value` lines of `launchctl print <domain>/<label>`
    (state, pid, program, path, stdout path, last exit code, ...), pure so it
    is tested against recorded outputs. Nested blocks (`arguments = {`,
    `environment = {`) are skipped; the first occurrence of a key wins."""
    out: dict[str, str] = {}
    depth = 0
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{"):
            depth += 1
            continue
        if stripped == "}":
            depth = max(0, depth - 1)
            continue
        if depth == 1 and " = " in stripped:
            key, _, value = stripped.partition(" = ")
            out.setdefault(key.strip(), value.strip())
    return out


def describe_print(text: str) -> str:
    """One line from `launchctl print`: state, pid, last exit code."""
    f = parse_print(text)
    parts = [f"state {f.get('state', '?')}"]
    if "pid" in f:
        parts.append(f"pid {f['pid']}")
    if "last exit code" in f:
        parts.append(f"last exit code {f['last exit code']}")
    return ", ".join(parts)
