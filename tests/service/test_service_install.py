"""kvd service install|uninstall|status, into a fake HOME with the command runner replaced."""

from __future__ import annotations

import json
import os
import plistlib
import stat
import sys

import pytest
from click.testing import CliRunner

from kvd.cli import main, service_cmd  # noqa: F401  (registers `kvd service`)
from kvd.service import install as svc
from kvd.service import launchd, systemd


class FakeRunner:
    """Records commands; answers each with a canned Result (default: success)."""

    def __init__(self, results: dict[tuple[str, ...], svc.Result] | None = None):
        self.calls: list[tuple[str, ...]] = []
        self.results = results or {}

    def __call__(self, argv):
        argv = tuple(argv)
        self.calls.append(argv)
        for prefix, result in self.results.items():
            if argv[: len(prefix)] == prefix:
                return result
        return svc.Result(0)


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for k in list(os.environ):
        if k.startswith(("XDG_", "KVD_")):
            monkeypatch.delenv(k)
    return h


@pytest.fixture
def runner(monkeypatch):
    fake = FakeRunner()
    monkeypatch.setattr(svc, "run_command", fake)
    return fake


def files_under(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def cli(*args):
    return CliRunner().invoke(main, ["service", *args])


def test_detect_init():
    assert svc.detect_init("darwin") == "launchd"
    assert svc.detect_init("linux") == "systemd"
    with pytest.raises(svc.UnsupportedPlatform, match="win32"):
        svc.detect_init("win32")


@pytest.mark.parametrize("init", ["systemd", "launchd"])
def test_dry_runs_change_nothing(home, runner, init):
    r = cli("install", "--dry-run", "--init", init, "--", "--ram-mb", "2048")
    assert r.exit_code == 0, r.output
    assert "dry run: nothing was changed" in r.output
    if init == "systemd":
        assert f"# write {home}/.config/systemd/user/kvd.service:" in r.output
        assert systemd.render_unit(sys.executable, ["--ram-mb", "2048"]).rstrip() in r.output
        assert r.output.rstrip().endswith("$ systemctl --user enable --now kvd.service")
    else:
        assert f"# write {home}/Library/LaunchAgents/io.kvd.daemon.plist:" in r.output
        assert "<string>--ram-mb</string>" in r.output
        assert f"$ launchctl bootstrap gui/{os.getuid()} {home}/Library/LaunchAgents/io.kvd.daemon.plist" in r.output
    r = cli("uninstall", "--dry-run", "--init", init)
    assert r.exit_code == 0, r.output
    assert "$ rm -f" in r.output
    assert runner.calls == [] and files_under(home) == []


def test_systemd_install_and_uninstall(home, runner):
    r = cli("install", "--init", "systemd")
    assert r.exit_code == 0, r.output
    unit = home / ".config" / "systemd" / "user" / "kvd.service"
    assert unit.read_text() == systemd.render_unit(os.path.abspath(sys.executable))
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    assert files_under(home) == [".config", ".config/systemd", ".config/systemd/user",
                                 ".config/systemd/user/kvd.service"]
    ctl = ("systemctl", "--user")
    assert runner.calls == [ctl + ("daemon-reload",), ctl + ("try-restart", "kvd.service"),
                            ctl + ("enable", "--now", "kvd.service")]

    runner.calls.clear()
    assert cli("install", "--init", "systemd").exit_code == 0  # idempotent
    assert unit.is_file()

    runner.calls.clear()
    r = cli("uninstall", "--init", "systemd")
    assert r.exit_code == 0, r.output
    assert not unit.exists()
    assert runner.calls == [ctl + ("disable", "--now", "kvd.service"), ctl + ("daemon-reload",),
                            ctl + ("reset-failed", "kvd.service")]
    assert cli("uninstall", "--init", "systemd").exit_code == 0  # nothing to remove: fine


def test_install_sets_the_stop_grace_from_the_stop_timeout_in_effect(home, runner, monkeypatch, tmp_path):
    unit = home / ".config" / "systemd" / "user" / "kvd.service"
    assert cli("install", "--init", "systemd", "--", "--stop-timeout", "30").exit_code == 0
    assert "\nTimeoutStopSec=35\n" in unit.read_text()
    config = tmp_path / "kvd.toml"
    config.write_text("stop_timeout = 4\n")
    monkeypatch.setenv("KVD_CONFIG", str(config))
    assert cli("install", "--init", "launchd").exit_code == 0
    plist = plistlib.loads((home / "Library" / "LaunchAgents" / "io.kvd.daemon.plist").read_bytes())
    assert plist["ExitTimeOut"] == 9
    config.write_text("stop_timeout = -1\n")
    r = cli("install", "--init", "systemd")
    assert r.exit_code == 78 and "stop_timeout" in r.output


def test_systemd_honours_xdg_config_home(home, runner, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert cli("install", "--init", "systemd").exit_code == 0
    assert (tmp_path / "cfg" / "systemd" / "user" / "kvd.service").is_file()


def test_launchd_install_and_uninstall(home, runner):
    uid = os.getuid()
    r = cli("install", "--init", "launchd", "--", "--ram-mb", "4096")
    assert r.exit_code == 0, r.output
    path = home / "Library" / "LaunchAgents" / "io.kvd.daemon.plist"
    d = plistlib.loads(path.read_bytes())
    assert d["ProgramArguments"] == [os.path.abspath(sys.executable), "-m", "kvd", "serve", "--ram-mb", "4096"]
    assert d["StandardErrorPath"] == str(home / "Library" / "Logs" / "kvd" / "kvd.err.log")
    assert (home / "Library" / "Logs" / "kvd").is_dir()  # launchd does not create it
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    label = f"gui/{uid}/{launchd.LABEL}"
    assert runner.calls == [("launchctl", "bootout", label), ("launchctl", "enable", label),
                            ("launchctl", "bootstrap", f"gui/{uid}", str(path))]
    runner.calls.clear()
    assert cli("uninstall", "--init", "launchd").exit_code == 0
    assert not path.exists()
    assert runner.calls == [("launchctl", "bootout", label)]


def test_harmless_failures_are_ignored_and_real_ones_reported(home, runner):
    runner.results[("launchctl", "bootout")] = svc.Result(3, "", "Boot-out failed: 3: No such process")
    assert cli("install", "--init", "launchd").exit_code == 0
    runner.results[("launchctl", "bootstrap")] = svc.Result(5, "", "Bootstrap failed: 5: Input/output error")
    r = cli("install", "--init", "launchd")
    assert r.exit_code == svc.EXIT_FAILED
    assert "launchctl bootstrap" in r.output and "Input/output error" in r.output

    runner.results[("systemctl", "--user", "daemon-reload")] = svc.Result(
        1, "", "Failed to connect to bus: No medium found")
    r = cli("install", "--init", "systemd")
    assert r.exit_code == svc.EXIT_FAILED and "Failed to connect to bus" in r.output


def test_missing_program_is_reported(home, monkeypatch):
    # The real runner turns a missing launchctl/systemctl into exit 127.
    result = svc.run_command(["/nonexistent/launchctl", "print"])
    assert result.returncode == 127 and "launchctl" in result.stderr
    monkeypatch.setattr(svc, "run_command", lambda argv: svc.Result(127, "", f"{argv[0]}: not found"))
    r = cli("install", "--init", "launchd")
    assert r.exit_code == svc.EXIT_FAILED and "exited 127: launchctl: not found" in r.output


@pytest.mark.parametrize("answering, code", [(True, 0), (False, svc.EXIT_NOT_ANSWERING)])
def test_status_systemd(home, runner, monkeypatch, answering, code):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    pinged = []
    monkeypatch.setattr(svc, "ping", lambda ep: (pinged.append(ep) or (answering, "why")))
    runner.results[("systemctl", "--user", "is-active")] = svc.Result(0 if answering else 3,
                                                                      "active\n" if answering else "inactive\n")
    r = CliRunner().invoke(main, ["service", "status", "--init", "systemd", "--json"])
    assert r.exit_code == code, r.output
    data = json.loads(r.output)
    assert data["installed"] is False and data["loaded"] is answering
    assert data["endpoint"] == "ipc:///run/user/1234/kvd/kvd.sock" == pinged[0]
    assert data["answering"] is answering and data["exit_code"] == code

    cli("install", "--init", "systemd")
    r = CliRunner().invoke(main, ["service", "status", "--init", "systemd"])
    assert r.exit_code == code
    assert r.output.splitlines()[0].startswith("installed: yes (")
    assert r.output.splitlines()[1].startswith("loaded:    " + ("yes (active)" if answering else "no (inactive)"))


def test_status_launchd_uses_configured_endpoint(home, runner, monkeypatch):
    monkeypatch.setenv("KVD_ENDPOINT", "ipc:///tmp/kvd-status-test.sock")
    monkeypatch.setattr(svc, "ping", lambda ep: (False, f"nobody at {ep}"))
    runner.results[("launchctl", "print")] = svc.Result(113, "", "Could not find service")
    r = CliRunner().invoke(main, ["service", "status", "--init", "launchd"])
    assert r.exit_code == svc.EXIT_NOT_ANSWERING
    assert "loaded:    no (not bootstrapped)" in r.output
    assert "answering: no (ipc:///tmp/kvd-status-test.sock: nobody at ipc:///tmp/kvd-status-test.sock)" in r.output
    assert runner.calls == [("launchctl", "print", f"gui/{os.getuid()}/{launchd.LABEL}")]


def test_status_pings_a_real_daemon(home, runner, kvd_daemon):
    r = CliRunner().invoke(main, ["service", "status", "--init", "systemd", "--endpoint", kvd_daemon.endpoint])
    assert r.exit_code == 0, r.output
    assert "answering: yes" in r.output and "ping" in r.output
    kvd_daemon.stop()
    r = CliRunner().invoke(main, ["service", "status", "--init", "systemd", "--endpoint", kvd_daemon.endpoint])
    assert r.exit_code == svc.EXIT_NOT_ANSWERING and "answering: no" in r.output
