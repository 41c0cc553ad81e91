"""Install, uninstall and inspect kvd as a per-user service.

Theory of operation
-------------------
Each action is first planned as data (`Plan`: files to write or remove,
folders to create, commands to run), then either printed (`--dry-run`) or
applied. Planning never touches the machine, so it is tested byte for byte;
applying goes through one replaceable command runner (`run_command`), so tests
install into a fake home without calling launchctl or systemctl.

Rules:
1. The service runs the interpreter kvd is installed into (`sys.executable`,
   not resolved through symlinks: a virtualenv's python must stay the venv's).
2. Files are written atomically (temp file, then rename), mode 0644 -- or
   0600 when the serve arguments hold a secret (a remote_url's password):
   launchd and a user's systemd read them as that user.
3. Install is idempotent: a re-install replaces the file and restarts a
   running daemon; uninstall of something not installed succeeds.
4. Commands whose failure only means "already in that state" (bootout of an
   unloaded agent, disable of an unknown unit) are marked `check=False`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from kvd.protocol.errors import KvdError
from kvd.service import launchd, systemd

# CLI exit codes, the same numbers as kvd.cli.exits (this layer does not import the CLI).
EXIT_OK = 0
EXIT_FAILED = 1  # a launchctl/systemctl command failed, or no known init system
EXIT_USAGE = 2  # a SERVE_ARG no service file can carry (check_serve_args)
EXIT_NOT_ANSWERING = 3  # status: no daemon answered at the endpoint

INIT_SYSTEMS = ("launchd", "systemd")


class ServiceError(KvdError):
    """An install/uninstall step failed; `exit_code` is what the CLI exits with."""

    exit_code = EXIT_FAILED


class UnsupportedPlatform(ServiceError):
    """This OS has no init system kvd knows how to use."""


class CommandFailed(ServiceError):
    """A launchctl/systemctl command exited non-zero."""


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    check: bool = True  # False: a failure means "already in that state"

    def __str__(self) -> str:
        return " ".join(_shell_quote(a) for a in self.argv)


@dataclass
class Plan:
    """What an action does, in order: make folders, write/remove files, run commands."""

    init: str
    action: str
    path: Path  # the service file
    content: bytes | None = None  # None: remove `path` instead of writing it
    mode: int = 0o644  # of the file written (rule 2)
    mkdirs: list[Path] = field(default_factory=list)
    before: list[Command] = field(default_factory=list)  # run before the file step
    after: list[Command] = field(default_factory=list)  # run after the file step

    def describe(self) -> str:
        """Return the plan as text for --dry-run: the file, then the commands."""
        lines = [f"# kvd service {self.action} ({self.init}), dry run: nothing was changed"]
        lines += [f"$ {c}{'' if c.check else '   # may fail harmlessly'}" for c in self.before]
        lines += [f"$ mkdir -p {_shell_quote(str(d))}" for d in self.mkdirs]
        if self.content is None:
            lines.append(f"$ rm -f {_shell_quote(str(self.path))}")
        else:
            lines.append(f"# write {self.path}{mode_note(self.mode)}:")
            lines.append(self.content.decode().rstrip("\n"))
            lines.append(f"# end of {self.path}")
        lines += [f"$ {c}{'' if c.check else '   # may fail harmlessly'}" for c in self.after]
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str = ""
    stderr: str = ""


Runner = Callable[[Sequence[str]], Result]


def run_command(argv: Sequence[str]) -> Result:
    """Run a command, capturing output; return its Result (a missing program is 127)."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    except FileNotFoundError as exc:
        return Result(127, "", f"{argv[0]}: {exc.strerror}")
    except subprocess.TimeoutExpired:
        return Result(124, "", f"{argv[0]}: timed out after 120 s")
    return Result(p.returncode, p.stdout, p.stderr)


def _shell_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def detect_init(platform: str | None = None) -> str:
    """Return "launchd" on macOS, "systemd" on Linux; raise UnsupportedPlatform otherwise."""
    platform = sys.platform if platform is None else platform
    if platform == "darwin":
        return "launchd"
    if platform.startswith("linux"):
        return "systemd"
    raise UnsupportedPlatform(f"kvd service supports macOS (launchd) and Linux (systemd), not {platform}")


@dataclass(frozen=True)
class Target:
    """Who and where: the init system, home folder, uid, interpreter and environment."""

    init: str
    home: Path
    uid: int
    python: str
    environ: Mapping[str, str]

    @classmethod
    def current(cls, init: str | None = None, environ: Mapping[str, str] | None = None) -> "Target":
        """Return the Target of this user and interpreter (init auto-detected if None)."""
        environ = os.environ if environ is None else environ
        from kvd.host.dirs import home_folder

        home = home_folder(environ)
        return cls(init or detect_init(), home, os.getuid(), os.path.abspath(sys.executable), environ)

    @property
    def service_path(self) -> Path:
        if self.init == "launchd":
            return Path(launchd.plist_path(self.home))
        return Path(systemd.unit_path(self.home, self.environ))

    @property
    def launchd_domain(self) -> str:
        return f"gui/{self.uid}"


def mode_note(mode: int) -> str:
    """What the install says about a file's mode: only 0600 is worth a word."""
    return " (mode 0600: it holds a password)" if mode == 0o600 else ""


def holds_secret(args: Sequence[str]) -> bool:
    """Whether a serve argument looks like a URL with credentials: userinfo
    before an `@` (redis://:password@host), or a password= parameter. Text
    only, and generous: a false alarm costs a 0600 file, nothing more."""
    for arg in args:
        _, sep, rest = str(arg).partition("://")
        if sep and ("@" in rest or "password=" in rest.lower()):
            return True
    return False


def check_serve_args(args: Sequence[str]) -> None:
    """Raise ValueError, naming it, for an argument no service file can
    carry: a control character (a newline would add lines of its own to a
    unit file) or text that is not UTF-8. A usage error (EXIT_USAGE)."""
    for i, arg in enumerate(args, 1):
        try:
            systemd.check_arg(str(arg))
        except ValueError as exc:
            arg = str(arg)
            shown = repr(arg if len(arg) <= 40 else arg[:37] + "...")  # repr escapes what the check refused
            raise ValueError(f"serve argument {i} {shown} {exc}") from None


def install_plan(t: Target, extra_args: Sequence[str] = (), stop_timeout: float = systemd.DEFAULT_STOP_TIMEOUT) -> Plan:
    """Return the Plan that installs and starts the service for Target `t`;
    the service manager waits a little more than `stop_timeout` (the daemon's
    setting in effect) before it kills a stopping daemon. The file is 0600
    if `extra_args` hold a secret (rule 2).

    Raises ValueError for an argument no service file can carry
    (check_serve_args).
    """
    check_serve_args(extra_args)
    mode = 0o600 if holds_secret(extra_args) else 0o644
    path = t.service_path
    if t.init == "launchd":
        label = f"{t.launchd_domain}/{launchd.LABEL}"
        return Plan(
            "launchd", "install", path,
            content=launchd.render_plist(home=t.home, python=t.python, extra_args=extra_args, stop_timeout=stop_timeout),
            mode=mode,
            mkdirs=[path.parent, Path(launchd.log_dir(t.home))],
            # A loaded agent keeps its old definition: unload it first.
            before=[Command(("launchctl", "bootout", label), check=False)],
            after=[
                Command(("launchctl", "enable", label)),
                Command(("launchctl", "bootstrap", t.launchd_domain, str(path))),
            ],
        )
    ctl = ("systemctl", "--user")
    return Plan(
        "systemd", "install", path,
        content=systemd.render_unit(t.python, extra_args=extra_args, stop_timeout=stop_timeout).encode(),
        mode=mode,
        mkdirs=[path.parent],
        after=[
            Command(ctl + ("daemon-reload",)),
            # Restart a daemon running the old unit; then start it if it was not running.
            Command(ctl + ("try-restart", systemd.UNIT_NAME)),
            Command(ctl + ("enable", "--now", systemd.UNIT_NAME)),
        ],
    )


def uninstall_plan(t: Target) -> Plan:
    """Return the Plan that stops the service and removes its file for Target `t`."""
    path = t.service_path
    if t.init == "launchd":
        label = f"{t.launchd_domain}/{launchd.LABEL}"
        return Plan("launchd", "uninstall", path, None,
                    before=[Command(("launchctl", "bootout", label), check=False)])
    ctl = ("systemctl", "--user")
    return Plan(
        "systemd", "uninstall", path, None,
        before=[Command(ctl + ("disable", "--now", systemd.UNIT_NAME), check=False)],
        after=[
            Command(ctl + ("daemon-reload",)),
            Command(ctl + ("reset-failed", systemd.UNIT_NAME), check=False),
        ],
    )


def _run_all(cmds: Sequence[Command], runner: Runner) -> None:
    for c in cmds:
        r = runner(c.argv)
        if r.returncode != 0 and c.check:
            detail = (r.stderr or r.stdout).strip()
            raise CommandFailed(f"`{c}` exited {r.returncode}" + (f": {detail}" if detail else ""))


def _write_atomic(path: Path, content: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover of a crashed run keeps its old mode: start afresh
    # Created 0600 and opened up after: a secret is never readable by others, not even for a moment.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # the umask must not make a plist launchd refuses
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def apply(plan: Plan, runner: Runner | None = None) -> None:
    """Carry out `plan`. Raises CommandFailed (a checked command failed) or OSError."""
    runner = runner or run_command
    _run_all(plan.before, runner)
    for d in plan.mkdirs:
        d.mkdir(parents=True, exist_ok=True)
    if plan.content is None:
        plan.path.unlink(missing_ok=True)
    else:
        _write_atomic(plan.path, plan.content, plan.mode)
    _run_all(plan.after, runner)


# --- status --------------------------------------------------------------------


@dataclass
class Status:
    init: str
    path: str
    installed: bool
    loaded: bool
    loaded_detail: str
    endpoint: str
    answering: bool
    answer_detail: str

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.answering else EXIT_NOT_ANSWERING

    def to_json(self) -> str:
        return json.dumps(self.__dict__ | {"exit_code": self.exit_code}, indent=2)

    def describe(self) -> str:
        yes = lambda b: "yes" if b else "no"  # noqa: E731
        return (
            f"installed: {yes(self.installed)} ({self.path})\n"
            f"loaded:    {yes(self.loaded)}{f' ({self.loaded_detail})' if self.loaded_detail else ''}\n"
            f"answering: {yes(self.answering)} ({self.endpoint}"
            f"{f': {self.answer_detail}' if self.answer_detail else ''})\n"
        )


def service_endpoint(t: Target) -> str | None:
    """Return the endpoint the installed unit binds (systemd), or None to use the config's."""
    if t.init == "systemd":
        from kvd.endpoint import runtime_endpoint

        return runtime_endpoint(t.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{t.uid}")
    return None


def ping(endpoint: str, timeout: float = 1.0) -> tuple[bool, str]:
    """Return (True, "rtt ...") if a daemon at `endpoint` answers a ping, else (False, why)."""
    try:
        from kvd_client import Client  # lazily: planning and rendering need no client

        with Client(endpoint, namespace="kvd-admin", timeout=timeout) as client:
            rtt = client.ping()
    except Exception as exc:  # any failure means "not answering"; say why
        return False, f"{type(exc).__name__}: {exc}"
    if rtt is None:
        return False, f"no reply within {timeout:g} s"
    return True, f"ping {rtt * 1000:.2f} ms"


def status(t: Target, endpoint: str, runner: Runner | None = None,
           pinger: Callable[[str], tuple[bool, str]] | None = None) -> Status:
    """Return whether the service is installed, loaded, and answering at `endpoint`."""
    runner = runner or run_command
    path = t.service_path
    if t.init == "launchd":
        r = runner(("launchctl", "print", f"{t.launchd_domain}/{launchd.LABEL}"))
        loaded = r.returncode == 0
        detail = launchd.describe_print(r.stdout or "") if loaded else "not bootstrapped"
    else:
        r = runner(("systemctl", "--user", "is-active", systemd.UNIT_NAME))
        detail = (r.stdout.strip() or r.stderr.strip()).splitlines()[0] if (r.stdout or r.stderr) else ""
        loaded = r.returncode == 0
    answering, why = (pinger or ping)(endpoint)
    return Status(t.init, str(path), path.is_file(), loaded, detail, endpoint, answering, why)
