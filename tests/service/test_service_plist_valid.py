"""The launchd agent plist kvd installs, validated as plutil and launchd would
(`launchd.validate_plist`, on any OS), breaking one thing at a time; on a Mac,
`plutil -lint` and a load/unload of the agent under a throwaway label."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys

import pytest

from kvd.service import launchd


def agent(**changes) -> bytes:
    d = launchd.plist_dict(home="/Users/ana", python="/Users/ana/.venv/bin/python")
    for key, value in changes.items():
        if value is None:
            d.pop(key)
        else:
            d[key] = value
    return plistlib.dumps(d, fmt=plistlib.FMT_XML, sort_keys=False)


def test_the_installed_plist_is_sound():
    data = launchd.render_plist(home="/Users/ana", python="/Users/ana/.venv/bin/python")
    assert launchd.validate_plist(data) == []
    assert plistlib.loads(data) == plistlib.loads(plistlib.dumps(plistlib.loads(data)))


@pytest.mark.parametrize("change, complaint", [
    ({"Label": None}, "Label missing"),
    ({"Label": ""}, "Label missing"),
    ({"ProgramArguments": None}, "neither Program"),
    ({"ProgramArguments": []}, "neither Program"),
    ({"ProgramArguments": ["python", "-m", "kvd"]}, "not an absolute path"),
    ({"RunAtLoad": "yes"}, "RunAtLoad has type str"),
    ({"KeepAlive": None}, "KeepAlive missing"),
    ({"StandardOutPath": None}, "StandardOutPath missing"),
    ({"StandardErrorPath": "kvd.err.log"}, "StandardErrorPath is not an absolute path"),
    ({"Umask": True}, "Umask has type bool"),
    ({"ProcessType": "Fast"}, "ProcessType 'Fast'"),
])
def test_each_broken_key_is_named(change, complaint):
    wrong = launchd.validate_plist(agent(**change))
    assert len(wrong) == 1 and complaint in wrong[0], wrong


def test_what_is_not_a_plist_says_so():
    assert launchd.validate_plist(b"<plist><dict><key>Label</key>")[0].startswith("not a property list")
    assert launchd.validate_plist(plistlib.dumps(["a"])) == ["the top level is not a dict"]


mac = pytest.mark.skipif(sys.platform != "darwin" or not shutil.which("launchctl"),
                         reason="plutil and launchctl exist only on macOS")


@mac
def test_plutil_lints_it(tmp_path):
    path = tmp_path / "io.kvd.daemon.plist"
    path.write_bytes(launchd.render_plist(home=str(tmp_path), python=sys.executable))
    r = subprocess.run(["plutil", "-lint", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


@mac
def test_launchd_loads_and_unloads_the_agent(tmp_path):
    # A throwaway label, so a real kvd agent of this user is left alone; the
    # agent runs `true` (kvd itself is not needed to test the plist's loading).
    label = f"io.kvd.test.{os.getpid()}"
    d = launchd.plist_dict(home=str(tmp_path), python=sys.executable, label=label)
    d["ProgramArguments"] = ["/usr/bin/true"]
    d["KeepAlive"] = False
    path = tmp_path / f"{label}.plist"
    path.write_bytes(plistlib.dumps(d))
    domain = f"gui/{os.getuid()}"
    r = subprocess.run(["launchctl", "bootstrap", domain, str(path)], capture_output=True, text=True)
    if r.returncode != 0 and "Domain does not support" in r.stderr:
        pytest.skip(f"no GUI login session for {domain} (CI without one): {r.stderr.strip()}")
    try:
        assert r.returncode == 0, r.stderr
        p = subprocess.run(["launchctl", "print", f"{domain}/{label}"], capture_output=True, text=True)
        assert p.returncode == 0 and launchd.parse_print(p.stdout)["path"] == str(path)
    finally:
        subprocess.run(["launchctl", "bootout", f"{domain}/{label}"], capture_output=True)
    p = subprocess.run(["launchctl", "print", f"{domain}/{label}"], capture_output=True, text=True)
    assert p.returncode != 0
