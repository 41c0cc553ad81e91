"""kvd.service.launchd: the agent plist, checked key by key after a plistlib round trip."""

from __future__ import annotations

import plistlib

import pytest

from kvd.service import launchd

from support import REPO

HOME = "/Users/alice"
PYTHON = "/Users/alice/venvs/kvd 2/bin/python3"  # a space: no shell may be involved


def test_render_plist_keys_and_types():
    raw = launchd.render_plist(home=HOME, python=PYTHON, extra_args=("--ram-mb", 4096))
    assert raw.startswith(b"<?xml")
    d = plistlib.loads(raw)
    assert d["Label"] == "io.kvd.daemon"
    assert d["ProgramArguments"] == [PYTHON, "-m", "kvd", "serve", "--ram-mb", "4096"]
    assert all(isinstance(a, str) for a in d["ProgramArguments"])
    assert d["RunAtLoad"] is True
    assert d["KeepAlive"] == {"SuccessfulExit": False}
    assert d["ProcessType"] == "Interactive"
    assert d["Umask"] == 63 and type(d["Umask"]) is int
    # kvd ends a stop within stop_timeout (10 s by default); launchd waits a little more.
    assert type(d["ExitTimeOut"]) is int and d["ExitTimeOut"] == 15
    assert plistlib.loads(launchd.render_plist(home=HOME, python=PYTHON, stop_timeout=3))["ExitTimeOut"] == 8
    assert d["WorkingDirectory"] == HOME
    assert d["StandardOutPath"] == f"{HOME}/Library/Logs/kvd/kvd.out.log"
    assert d["StandardErrorPath"] == f"{HOME}/Library/Logs/kvd/kvd.err.log"
    env = d["EnvironmentVariables"]
    assert env["PATH"].split(":")[0] == "/Users/alice/venvs/kvd 2/bin"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert all(isinstance(v, str) for v in env.values())


def test_every_path_is_absolute_and_under_the_fake_home():
    d = plistlib.loads(launchd.render_plist(home=HOME, python=PYTHON))
    paths = [d["ProgramArguments"][0], d["WorkingDirectory"], d["StandardOutPath"], d["StandardErrorPath"]]
    paths += [p for p in d["EnvironmentVariables"]["PATH"].split(":")]
    for p in paths:
        assert p.startswith("/"), p
    for p in paths[:4]:
        assert p.startswith(HOME), p
    assert str(launchd.plist_path(HOME)) == f"{HOME}/Library/LaunchAgents/io.kvd.daemon.plist"
    assert str(launchd.plist_path(HOME, "x.y")) == f"{HOME}/Library/LaunchAgents/x.y.plist"


def test_round_trip_is_stable():
    raw = launchd.render_plist(home=HOME, python=PYTHON, label="io.kvd.test")
    d = plistlib.loads(raw)
    assert d["Label"] == "io.kvd.test"
    assert plistlib.dumps(d, sort_keys=False) == raw
    assert d == launchd.plist_dict(home=HOME, python=PYTHON, label="io.kvd.test")


@pytest.mark.parametrize("kw", [{"home": "Users/x", "python": PYTHON}, {"home": HOME, "python": "python3"}])
def test_relative_paths_are_refused(kw):
    with pytest.raises(ValueError, match="absolute"):
        launchd.render_plist(**kw)


def test_repository_example_is_current():
    example = (REPO / "launchd" / "io.kvd.daemon.plist").read_bytes()
    assert example == launchd.render_plist(home=launchd.EXAMPLE_HOME, python=launchd.EXAMPLE_PYTHON), (
        "regenerate: python -m kvd.service.launchd > launchd/io.kvd.daemon.plist"
    )
