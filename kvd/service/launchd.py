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


# launchd.plist(5): the keys kvd writes and the type launchd wants for each;
# Label and ProgramArguments (or Program) are required by launchd itself.
KEY_TYPES = {
    "Label": str, "Program": str, "ProgramArguments": list, "RunAtLoad": bool, "KeepAlive": (bool, dict),
    "ProcessType": str, "Umask": int, "ExitTimeOut": int, "WorkingDirectory": str,
    "StandardOutPath": str, "StandardErrorPath": str, "EnvironmentVariables": dict,
}
KVD_RELIES_ON = ("RunAtLoad", "KeepAlive", "StandardOutPath", "StandardErrorPath", "ProcessType")
PROCESS_TYPES = ("Background", "Standard", "Adaptive", "Interactive")


def validate_plist(data: bytes) -> list[str]:
    """What launchd (or `plutil -lint`) would object to in an agent plist, and
    what kvd relies on being there; [] when it is sound. Checks: it parses and
    round-trips through plistlib; the top level is a dict; Label is a non-empty
    string; ProgramArguments is a non-empty list of strings (or Program is set)
    whose first item is an absolute path; every known key has launchd's type;
    the keys kvd relies on are present; paths are absolute."""
    try:
        d = plistlib.loads(data)
    except Exception as exc:  # plistlib raises InvalidFileException, ExpatError, ValueError...
        return [f"not a property list: {type(exc).__name__}: {exc}"]
    if not isinstance(d, dict):
        return ["the top level is not a dict"]
    wrong = []
    if plistlib.loads(plistlib.dumps(d, fmt=plistlib.FMT_XML, sort_keys=False)) != d:
        wrong.append("does not round-trip through plistlib")
    for key, want in KEY_TYPES.items():
        if key in d and (not isinstance(d[key], want) or (want is int and isinstance(d[key], bool))):
            wrong.append(f"{key} has type {type(d[key]).__name__}")
    if not (isinstance(d.get("Label"), str) and d["Label"]):
        wrong.append("Label missing or empty")
    args = d.get("ProgramArguments")
    if "Program" not in d and not (isinstance(args, list) and args and all(isinstance(a, str) for a in args)):
        wrong.append("neither Program nor a non-empty ProgramArguments of strings")
    elif isinstance(args, list) and args and not str(d.get("Program", args[0])).startswith("/"):
        wrong.append("the program is not an absolute path")
    wrong += [f"{key} missing (kvd relies on it)" for key in KVD_RELIES_ON if key not in d]
    for key in ("StandardOutPath", "StandardErrorPath", "WorkingDirectory"):
        if isinstance(d.get(key), str) and not d[key].startswith("/"):
            wrong.append(f"{key} is not an absolute path")
    if "ProcessType" in d and d["ProcessType"] not in PROCESS_TYPES:
        wrong.append(f"ProcessType {d['ProcessType']!r} is not one of {', '.join(PROCESS_TYPES)}")
    return wrong


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
