"""The unit under a real systemd user manager: Type=notify, watchdog restart, hardening.

The manager runs privately: inside a mount namespace (`unshare -m`) a tmpfs is
bound over /run/systemd so `systemd --user` believes the machine booted with
systemd, with a throwaway HOME and XDG_RUNTIME_DIR. Needs root, unshare and
systemd; skipped otherwise. Nothing outside the namespace and tmp dirs changes.

Every test that runs such a manager is in this file, so no two run at once
(`./dev test` hands a file to one worker): two of root's managers started in
one cgroup make their units' cgroups in the same place (app.slice/kvd.service),
and one's stop sent SIGTERM to the other's daemon as it started (seen: the
other's start failed with Result=protocol, its daemon gone before READY=1).
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvd.service import systemd

from support import REPO

MANAGER = next((p for p in ("/lib/systemd/systemd", "/usr/lib/systemd/systemd") if os.access(p, os.X_OK)), None)


def _serve_sends_notifications() -> bool:
    import kvd.cli.serve

    return "Notifier" in inspect.getsource(kvd.cli.serve)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="needs root on Linux to run a private systemd user manager"),
    pytest.mark.skipif(MANAGER is None or shutil.which("unshare") is None or shutil.which("systemctl") is None,
                       reason="needs systemd and unshare (apt-get install -y systemd util-linux)"),
    pytest.mark.skipif(not _serve_sends_notifications(),
                       reason="kvd serve does not use kvd.service.notify.Notifier yet"),
]

# Mounts a private /run/systemd, starts a systemd user manager ($MANAGER) and waits for it.
MANAGER_UP = r"""
set -u
mkdir -p "$WORK/fakerun/system"
mount -t tmpfs tmpfs "$WORK/fakerun" && mkdir -p "$WORK/fakerun/system" && mount --bind "$WORK/fakerun" /run/systemd || { echo "SKIP=mount"; exit 0; }
export XDG_RUNTIME_DIR="$WORK/run" HOME="$WORK/home"
"$MANAGER" --user --log-target=kmsg >/dev/null 2>&1 &
MPID=$!
trap 'kill $MPID 2>/dev/null' EXIT
for i in $(seq 50); do [ -S "$XDG_RUNTIME_DIR/systemd/private" ] && break; sleep 0.1; done
[ -S "$XDG_RUNTIME_DIR/systemd/private" ] || { echo "SKIP=manager"; exit 0; }
"""

SCRIPT = MANAGER_UP + r"""
show() { echo "$1 $(systemctl --user show kvd.service -p ActiveState -p SubState -p Result -p NRestarts -p StatusText -p MainPID | tr '\n' ' ')"; }
systemctl --user daemon-reload
timeout 60 systemctl --user enable --now kvd.service; echo "START=$?"
show STARTED
"$PYTHON" -c "
from kvd_client import Client
with Client('ipc://$XDG_RUNTIME_DIR/kvd/kvd.sock', namespace='live', timeout=2) as c: print('PING=%s' % (c.ping() is not None))
"
P=$(systemctl --user show kvd.service -p MainPID --value)
[ "${P:-0}" -gt 1 ] && kill -STOP "$P"
for i in $(seq 100); do [ "$(systemctl --user show kvd.service -p NRestarts --value)" -ge 1 ] && break; sleep 0.1; done
show WEDGED
for i in $(seq 100); do [ "$(systemctl --user show kvd.service -p SubState --value)" = running ] && break; sleep 0.1; done
show RESTARTED
timeout 60 systemctl --user stop kvd.service; echo "STOP=$?"
echo "EXIT=$(systemctl --user show kvd.service -p ExecMainStatus --value)"
"""


def test_unit_under_a_real_user_manager():
    work = Path(tempfile.mkdtemp(prefix="kvds-", dir="/tmp"))
    try:
        (work / "run").mkdir(mode=0o700)
        units = work / "home" / ".config" / "systemd" / "user"
        units.mkdir(parents=True)
        text = systemd.render_unit(sys.executable).replace("WatchdogSec=30", "WatchdogSec=2")
        text = text.replace("Environment=PYTHONUNBUFFERED=1",
                            f"Environment=PYTHONUNBUFFERED=1 PYTHONPATH={REPO}\n"
                            f"StandardOutput=append:{work / 'kvd.log'}\nStandardError=inherit")
        (units / "kvd.service").write_text(text)
        env = {**os.environ, "WORK": str(work), "MANAGER": MANAGER, "PYTHON": sys.executable,
               "PYTHONPATH": str(REPO),
               # the manager finds user units under XDG_CONFIG_HOME: the throwaway HOME's
               "XDG_CONFIG_HOME": str(work / "home" / ".config"),
               "XDG_CACHE_HOME": str(work / "home" / ".cache")}
        r = subprocess.run(["unshare", "-m", "sh", "-c", SCRIPT], capture_output=True, text=True,
                           env=env, timeout=240)
        out = r.stdout
        if "SKIP=" in out or (r.returncode != 0 and "unshare" in r.stderr):
            pytest.skip(f"cannot run a private user manager here: {out.strip()} {r.stderr.strip()}")
        lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
        # What a failure shows: the daemon's log too (no journal here; the manager logs to kmsg).
        log = work / "kvd.log"
        why = out + r.stderr + ("\n--- kvd.log:\n" + log.read_text(errors="replace")[-6000:] if log.exists() else "")
        assert "START=0" in out, why
        assert "ActiveState=active" in lines["STARTED"] and "SubState=running" in lines["STARTED"], why
        assert "PING=True" in out, why
        assert "Result=watchdog" in lines["WEDGED"] or "NRestarts=1" in lines["WEDGED"], why
        assert "SubState=running" in lines["RESTARTED"] and "NRestarts=1" in lines["RESTARTED"], why
        assert "STOP=0" in out and "EXIT=0" in out, why
    finally:
        shutil.rmtree(work, ignore_errors=True)


_LIVE = MANAGER_UP + r"""
systemctl --user daemon-reload
timeout 60 systemctl --user start kvd.service; echo "START=$?"
P=$(systemctl --user show kvd.service -p MainPID --value)
echo "ARGV=$(tr '\0' '\n' < /proc/$P/cmdline | base64 -w0)"
timeout 60 systemctl --user stop kvd.service; echo "STOP=$?"
"""


def test_a_real_user_manager_passes_dollar_and_percent_through_literally(tmp_path):
    """`$` and `%` in a serve argument reach the daemon as typed (systemd would
    expand `$HOME`, `${USER}` and `%h` in an unescaped ExecStart=)."""
    import base64

    work = Path(tempfile.mkdtemp(prefix="kvds-", dir="/tmp"))
    try:
        (work / "run").mkdir(mode=0o700)
        (work / "logs").mkdir()
        units = work / "home" / ".config" / "systemd" / "user"
        units.mkdir(parents=True)
        log_file = f"{work}/logs/$HOME ${{USER}} 100%h $$.log"
        text = systemd.render_unit(sys.executable, extra_args=("--log-file", log_file, "--ram-mb", "64"))
        text = text.replace("Environment=PYTHONUNBUFFERED=1", f"Environment=PYTHONUNBUFFERED=1 PYTHONPATH={REPO}")
        (units / "kvd.service").write_text(text)
        env = {**os.environ, "WORK": str(work), "MANAGER": MANAGER, "PYTHONPATH": str(REPO),
               "XDG_CONFIG_HOME": str(work / "home" / ".config"), "XDG_CACHE_HOME": str(work / "home" / ".cache")}
        r = subprocess.run(["unshare", "-m", "sh", "-c", _LIVE], capture_output=True, text=True, env=env, timeout=240)
        if "SKIP=" in r.stdout or (r.returncode != 0 and "unshare" in r.stderr):
            pytest.skip(f"cannot run a private user manager here: {r.stdout.strip()} {r.stderr.strip()}")
        assert "START=0" in r.stdout and "STOP=0" in r.stdout, r.stdout + r.stderr
        (argv,) = [ln[5:] for ln in r.stdout.splitlines() if ln.startswith("ARGV=")]
        argv = base64.b64decode(argv).decode().split("\n")
        assert argv[argv.index("--log-file") + 1] == log_file, argv
        assert os.path.isfile(log_file)  # the daemon logged to the file named, not to an expansion of it
    finally:
        shutil.rmtree(work, ignore_errors=True)
