"""Hostile input on the operator surfaces: the pressure-source file, the
metrics port, config files, and `kvd service install` arguments.

Each test is a red-team finding, turned around: what an operator (or an
attacker with a loopback port) can point kvd at, and what kvd must do then --
keep serving, say one line, exit with its defined code.
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvd.cli import exits, main, service_cmd  # noqa: F401  (registers `kvd service`)
from kvd.config import ConfigError, resolve
from kvd.server import governor as pressure, metrics
from kvd.service import install as svc
from kvd.service import systemd
from support import REPO, free_port, scrape, wait_until
from test_service_install import home  # noqa: F401  (the fixture `svc_home` builds on)

ANALYZE = shutil.which("systemd-analyze")


# -- 1. --pressure-source file:PATH -------------------------------------------------


def test_pressure_fifo_neither_freezes_the_daemon_nor_its_stop(daemon_factory, tmp_path):
    fifo = tmp_path / "level"
    os.mkfifo(fifo)
    d = daemon_factory("--ram-mb", "64", "--pressure-source", f"file:{fifo}", "--pressure-poll-s", "0.05")
    try:
        with d.client("p", timeout=1.0) as c:
            # Several samples taken (each one read the FIFO), and every STATS answered meanwhile.
            st = wait_until(lambda: (s := c.stats()) and s["pressure"]["samples"] >= 5 and s, what="5 pressure samples")
            assert st["pressure"]["level"] == "normal"
            assert "FIFO" in st["pressure"]["reason"], st["pressure"]
            assert c.ping() is not None
        assert d.stop(timeout=10) == 0
        log = d.log()
        assert log.count("not a regular file") == 1, log  # one warning, not one per sample
    finally:
        # The old code sat in open() waiting for a writer: give it one, so teardown ends.
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


_SAMPLE_UNDER_1GIB = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from kvd.server.governor import file_source
s = file_source(sys.argv[1])()
print(s.level, "|", s.reason)
"""


@pytest.mark.parametrize("kind", ["zero", "huge"])
def test_pressure_file_is_read_bounded(tmp_path, kind):
    # Under a 1 GiB address-space limit: reading /dev/zero or a 2 GiB file whole cannot succeed.
    if kind == "zero":
        path, want = "/dev/zero", ("normal", "a character device, not a regular file")
    else:
        path = tmp_path / "level"
        with open(path, "wb") as f:
            f.write(b"critical\n")
            f.truncate(2 << 30)  # sparse: costs no disk
        want = ("critical", "critical")
    r = subprocess.run([sys.executable, "-c", _SAMPLE_UNDER_1GIB, str(path)], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    level, reason = r.stdout.strip().split(" | ", 1)
    assert level == want[0] and want[1] in reason, r.stdout


def test_pressure_file_problems_read_as_normal_and_warn_once(tmp_path, caplog):
    folder = tmp_path / "level.d"
    folder.mkdir()
    sample = pressure.file_source(folder)
    with caplog.at_level(logging.WARNING, logger="kvd.server"):
        got = [sample() for _ in range(3)]
    assert {s.level for s in got} == {"normal"} and "a folder" in got[0].reason
    assert len([r for r in caplog.records if "pressure source" in r.getMessage()]) == 1
    # Undecodable bytes are not a crash: the first word decides, as ever.
    level = tmp_path / "level"
    level.write_bytes(b"warn \xff\xfe\n")
    assert pressure.file_source(level)().level == "warn"
    level.write_bytes(b"\xff\xfe critical")
    assert pressure.file_source(level)().level == "normal"


# -- 2. scrapes share builds; series per namespace are bounded ------------------------


class _SlowCollector:
    def __init__(self, cpu_s: float = 0.0, wait_s: float = 0.0):
        self.cpu_s, self.wait_s, self.builds = cpu_s, wait_s, 0

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        self.builds += 1
        start = time.thread_time()
        while time.thread_time() - start < self.cpu_s:
            pass  # stands for a build of megabytes of text
        time.sleep(self.wait_s)  # stands for a build that waited for a core or the GIL
        yield GaugeMetricFamily("kvd_test_builds", "builds", value=self.builds)


def _exposition(**cost):
    from prometheus_client.core import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    collector = _SlowCollector(**cost)
    registry.register(collector)
    return metrics._Exposition(registry), collector


def test_concurrent_scrapes_share_one_build_and_an_expensive_one_is_reused():
    exp, collector = _exposition(cpu_s=metrics.CHEAP_BUILD_S * 2)
    start = threading.Barrier(4)
    bodies = []

    def scrape_once():
        start.wait()
        bodies.append(exp.get())

    threads = [threading.Thread(target=scrape_once) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # One build for all four: a build that ends after a scrape arrived is shared with it.
    assert collector.builds == 1 and len(set(bodies)) == 1
    assert exp.get() == bodies[0] and collector.builds == 1  # expensive: reused within REUSE_S


@pytest.mark.parametrize("cost", [{}, {"wait_s": metrics.CHEAP_BUILD_S * 2}], ids=["fast", "slow but cheap"])
def test_a_cheap_build_is_never_reused(cost):
    """Cheap is the exporter thread's CPU: a build that took long only
    waiting (a busy machine) is still built again for the next scrape."""
    exp, collector = _exposition(**cost)
    exp.get()
    exp.get()
    assert collector.builds == 2  # a scrape after a known sequence of requests shows exactly them


def test_namespace_series_are_the_most_recently_used():
    counters = {f"c{i}": {} for i in range(5)}  # oldest first, as the handler keeps them
    held = {"h-old": {"last_used": 1.0}, "h-new": {"last_used": 9.0}, "c4": {"last_used": 0.0}}
    assert metrics._recent_namespaces(counters, held, most=3) == ["c2", "c3", "c4"]
    assert metrics._recent_namespaces(counters, held, most=6) == ["c0", "c1", "c2", "c3", "c4", "h-new"]
    assert metrics._recent_namespaces({}, held, most=2) == ["h-new", "h-old"]


def test_scrape_counts_namespaces_it_does_not_list(daemon_factory, monkeypatch):
    port = free_port()
    d = daemon_factory("--ram-mb", "64", "--metrics-port", str(port))
    import numpy as np

    from support import prefix_snapshot

    toks = np.arange(256)
    for ns in ("a", "b"):
        with d.client(ns) as c:
            assert c.put(toks, prefix_snapshot(toks))
    m = scrape(port)
    assert m[("kvd_namespaces", ())] == 2
    assert m[("kvd_namespace_entries", (("namespace", "a"),))] == 1


# -- 3. idle metrics connections are bounded and time out -----------------------------


def _threads(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_idle_metrics_connections_are_capped(daemon_factory):
    port = free_port()
    d = daemon_factory("--ram-mb", "64", "--metrics-port", str(port))
    base = _threads(d.proc.pid)
    extra = 24
    socks = []
    try:
        for _ in range(metrics.MAX_CONNECTIONS + extra):
            s = socket.create_connection(("127.0.0.1", port), 5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            socks.append(s)
        # Past the cap a connection is answered 503 and closed at once, not given a thread.
        answered: dict[socket.socket, bytes] = {}
        with selectors.DefaultSelector() as sel:
            for s in socks:
                sel.register(s, selectors.EVENT_READ)
            deadline = time.monotonic() + 5
            while len(answered) < extra and time.monotonic() < deadline:
                for key, _ in sel.select(0.5):
                    answered[key.fileobj] = key.fileobj.recv(200)
                    sel.unregister(key.fileobj)
        assert len(answered) == extra and all(got.startswith(b"HTTP/1.0 503") for got in answered.values())
        assert _threads(d.proc.pid) <= base + metrics.MAX_CONNECTIONS
        with d.client("x", timeout=1.0) as c:
            assert c.ping() is not None
    finally:
        for s in socks:
            s.close()
    # Once they are gone, a scrape is served again.
    wait_until(lambda: _try_scrape(port), timeout=10, what="a scrape after the idle clients left")


def _try_scrape(port: int):
    try:
        return scrape(port)
    except OSError:
        return None


def test_an_idle_metrics_connection_is_closed_by_the_daemon(daemon_factory):
    port, idle_s = free_port(), 1.0
    d = daemon_factory("--ram-mb", "64", "--metrics-port", str(port), "--metrics-idle-s", str(idle_s))
    s = socket.create_connection(("127.0.0.1", port), 5)
    s.settimeout(idle_s + 10)
    t0 = time.monotonic()
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and then nothing
        got = s.recv(200)  # returns when the daemon closes its end
    except socket.timeout:
        got = None
    finally:
        s.close()
    assert got is not None and idle_s <= time.monotonic() - t0 < idle_s + 5
    assert d.proc.poll() is None


# -- 4. metrics port taken ------------------------------------------------------------


def test_metrics_port_taken_is_one_line_exit_78_and_cleans_up(daemon_factory):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        d = daemon_factory("--ram-mb", "64", "--metrics-port", str(port), start=False)
        d.start(wait=False)
        code = d.proc.wait(30)
    log = d.log()
    assert code == exits.CONFIG, log
    assert "Traceback" not in log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"127.0.0.1:{port} (metrics_port)" in errors[0], log
    assert not (d.workdir / "kvd.sock").exists()  # the endpoint was let go, as on any stop
    # The same endpoint and data dir serve at once: nothing was left held.
    d2 = daemon_factory("--ram-mb", "64", "--data-dir", str(d.data_dir), workdir=d.workdir)
    with d2.client("x") as c:
        assert c.ping() is not None


# -- 5, 6. config files, log_file ----------------------------------------------------

_BAD_FILES = {
    "deep_array": ("ram_mb = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    "deep_inline": ("quota = " + "{a=" * 3000 + "1" + "}" * 3000 + "\n", "nested too deeply"),
    "not_utf8": (b'endpoint = "\xff"\n', "not UTF-8 (byte 0xff on line 1)"),
    "big_int": ("metrics_port = 1" + "0" * 5000 + "\n", "4300 digits"),
    "log_file_nul": ('log_file = "/tmp/a\\u0000b"\n', "log_file (from file:"),
    "data_dir_nul": ('data_dir = "/tmp/a\\u0000b"\n', "NUL"),
    "log_file_dir": ('log_file = "."\n', "is a folder"),
    "log_file_no_folder": ('log_file = "no/such/folder/kvd.log"\n', "does not exist"),
}


def _write(path: Path, data) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


@pytest.mark.parametrize("case", sorted(_BAD_FILES))
def test_bad_config_file_is_a_config_error(tmp_path, case):
    data, words = _BAD_FILES[case]
    path = _write(tmp_path / "kvd.toml", data)
    with pytest.raises(ConfigError) as info:
        resolve({}, environ={}, config_path=path)
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("case", ["deep_array", "not_utf8", "big_int", "log_file_nul", "log_file_dir", "fifo", "dev_zero"])
def test_bad_config_file_kvd_config_and_serve_say_one_line_exit_78(tmp_path, case):
    if case == "fifo":
        path = tmp_path / "kvd.toml"
        os.mkfifo(path)
        words = "is a FIFO, not a file"
    elif case == "dev_zero":
        path, words = Path("/dev/zero"), "is a character device, not a file"
    else:
        data, words = _BAD_FILES[case]
        path = _write(tmp_path / "kvd.toml", data)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    sock = tmp_path / "s.sock"
    for argv in (["config"], ["serve", "--endpoint", f"ipc://{sock}", "--data-dir", str(tmp_path / "data")]):
        r = subprocess.run([sys.executable, "-m", "kvd", *argv, "--config", str(path)], capture_output=True,
                           text=True, timeout=60, env=env, cwd=tmp_path)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 78 and len(lines) == 1 and words in lines[0], (argv, r.returncode, r.stderr[-3000:])


def test_log_file_checked_against_its_final_path(tmp_path, monkeypatch):
    (tmp_path / "logs").mkdir()
    path = _write(tmp_path / "kvd.toml", 'log_file = "logs/kvd.log"\n')  # relative to the file's folder
    monkeypatch.chdir("/")
    assert resolve({}, environ={}, config_path=path).log_file == str(tmp_path / "logs" / "kvd.log")
    with pytest.raises(ConfigError, match=r"log_file \(from flag:--log-file\): .* is a folder"):
        resolve({"log_file": str(tmp_path / "logs")}, environ={}, config_path=path)
    with pytest.raises(ConfigError, match=r"log_file \(from env:KVD_LOG_FILE\): .*NUL"):
        resolve({}, environ={"KVD_LOG_FILE": "/tmp/a\0b"}, config_path=path)


def test_a_log_file_serve_cannot_open_is_one_line_exit_78(tmp_path):
    # /proc exists, so the settings table lets it by; only open() can tell.
    config = _write(tmp_path / "kvd.toml", "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--endpoint", f"ipc://{tmp_path}/s.sock", "--data-dir", "none",
                        "--log-file", "/proc/kvd.log", "--config", str(config)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 78 and r.stderr.strip() == "kvd: log_file /proc/kvd.log: cannot open: No such file or directory", r.stderr


ROOT = os.geteuid() == 0


def test_a_fifo_log_file_is_a_config_error_not_a_start_that_hangs(tmp_path):
    """Red-team (session 41): opening a FIFO for appending blocked `kvd serve`
    before it bound, silently (a service manager's start timeout, again and again)."""
    os.mkfifo(tmp_path / "kvd.log")
    with pytest.raises(ConfigError, match="is a FIFO nobody reads"):
        resolve({"log_file": str(tmp_path / "kvd.log")}, environ={})
    for device in ("/dev/stderr", "/dev/null"):  # (what containers and units log to: devices, kept)
        assert resolve({"log_file": device}, environ={}).log_file == device


@pytest.mark.skipif(not ROOT, reason="a symlink of another uid needs root to make")
def test_a_log_file_or_data_dir_symlinked_by_another_user_is_refused(tmp_path):
    """Red-team (session 41): links another user planted in a shared folder
    (/tmp) had kvd append its log to, and chmod and fill, whatever they named.
    The user's own links still work (a data dir on another disk)."""
    from kvd.store.datadir import ensure_dirs

    target = tmp_path / "victim"
    target.mkdir(mode=0o755)
    (target / "file.txt").write_text("precious")
    for name, to in (("kvd.log", target / "file.txt"), ("kvd-data", target)):
        os.symlink(to, tmp_path / name)
        os.lchown(tmp_path / name, 65534, 65534)
    with pytest.raises(ConfigError, match="is a symlink of uid 65534"):
        resolve({"log_file": str(tmp_path / "kvd.log")}, environ={})
    with pytest.raises(PermissionError, match="symlink of uid 65534"):
        ensure_dirs(tmp_path / "kvd-data")
    assert (target / "file.txt").read_text() == "precious" and stat.S_IMODE(target.stat().st_mode) == 0o755
    assert sorted(p.name for p in target.iterdir()) == ["file.txt"]
    os.symlink(target, tmp_path / "mine")  # ours: used
    assert ensure_dirs(tmp_path / "mine") == tmp_path / "mine" and (target / "index").is_dir()
    home = tmp_path / "home"  # another user's link in that user's own folder: theirs to make (protected_symlinks' rule)
    home.mkdir()
    os.symlink(tmp_path / "victim" / "file.txt", home / "kvd.log")
    os.lchown(home / "kvd.log", 65534, 65534)
    os.chown(home, 65534, 65534)
    assert resolve({"log_file": str(home / "kvd.log")}, environ={}).log_file == str(home / "kvd.log")


def test_no_home_folder_is_one_line_exit_1_and_xdg_folders_need_none(monkeypatch):
    """Red-team (session 41): with HOME unset and no passwd entry (a container
    run as `-u N`) every command, `--help` included, died with a traceback."""
    from pathlib import Path

    from kvd.host import dirs

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert dirs.config_dir({"XDG_CONFIG_HOME": "/x"}, "linux") == Path("/x/kvd")
    assert dirs.cache_dir({"XDG_CACHE_HOME": "/y"}, "linux") == Path("/y/kvd")
    for environ in ({}, {"HOME": "relative"}):
        with pytest.raises(OSError) as err:
            dirs.config_dir(environ, "linux")
        code, line = exits.describe(err.value)
        assert code == exits.FAILED and line.startswith("no home folder") and "\n" not in line


def test_a_dry_run_gc_heals_nothing(tmp_path):
    """Red-team (session 41): `kvd gc --dry-run` with no daemon opened the
    store, which moved a damaged index aside and rebuilt it."""
    from kvd.store.ssd import offline
    from kvd.store.ssd.heal import IndexDamaged

    (tmp_path / "index").mkdir()
    garbage = os.urandom(10_000)
    (tmp_path / "index" / "data.mdb").write_bytes(garbage)
    with pytest.raises(IndexDamaged):
        offline.gc(tmp_path, orphans=True, dry_run=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]
    assert (tmp_path / "index" / "data.mdb").read_bytes() == garbage


def test_operator_flags_and_files_that_are_not_what_they_say_are_one_line(tmp_path):
    """Red-team (session 41): `--watch nan`, `--interval 1e300`, a certificate
    of garbage, a namespace of bytes no UTF-8 has: each was a traceback."""
    from kvd.endpoint import UnsafeEndpoint, read_cert

    runner = CliRunner()
    for args in (["stats", "--watch", "nan"], ["stats", "--watch", "inf"], ["top", "--interval", "1e300"]):
        r = runner.invoke(main, [*args, "--endpoint", f"ipc://{tmp_path}/none.sock"])
        assert r.exit_code == exits.USAGE, r.output
    bad = tmp_path / "bad.key"
    for text in ("garbage\n", "curve\n    public-key\n", 'curve\n    public-key = "abc"\n'):
        bad.write_text(text)
        bad.chmod(0o600)
        with pytest.raises(UnsafeEndpoint, match="not a ZeroMQ certificate"):
            read_cert(bad)
    code, line = exits.describe(UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed"))
    assert code == exits.USAGE and "not UTF-8" in line


# -- 7, 8. kvd service install --------------------------------------------------------


@pytest.fixture
def svc_home(home, monkeypatch):
    """test_service_install's `home`, with systemctl/launchctl never run."""
    monkeypatch.setattr(svc, "run_command", lambda argv: svc.Result(0))
    return home


def _cli(*args):
    return CliRunner().invoke(main, ["service", *args])


def _exec_start(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    return line


@pytest.mark.parametrize("init", ["systemd", "launchd"])
@pytest.mark.parametrize("arg", ["info\nExecStartPre=/usr/bin/touch /tmp/owned\n#", "a\rb", "a\x00b", "a\x7fb", "/tmp/\udcff"])
def test_install_refuses_arguments_no_service_file_can_carry(svc_home, init, arg):
    r = _cli("install", "--init", init, "--", "--log-level", arg)
    assert r.exit_code == exits.USAGE, r.output
    assert "Traceback" not in r.output and r.output.count("\n") == 1, r.output
    assert "serve argument 2" in r.output
    assert not any(svc_home.rglob("*.service")) and not any(svc_home.rglob("*.plist"))  # nothing written


def test_exec_start_escapes_dollar_percent_and_empty_words():
    line = _exec_start(systemd.render_unit("/usr/bin/python3", extra_args=(
        "--remote-url", "redis://:pa$$w0rd@h:6379", "--log-file", "/var/log/${USER}/100%.log", "--x", "$HOME", "")))
    assert line.endswith(' --remote-url "redis://:pa$$$$w0rd@h:6379" --log-file "/var/log/$${USER}/100%%.log"'
                         ' --x "$$HOME" ""')
    with pytest.raises(ValueError, match="control character"):
        systemd.render_unit("/usr/bin/python3", extra_args=("a\nb",))


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_hostile_but_legal_arguments(tmp_path):
    from test_service_systemd import verify

    text = systemd.render_unit(sys.executable, extra_args=(
        "--remote-url", "redis://:p$a%s;s w\\d\"'@127.0.0.1:6379", "--log-file", "/tmp/${X} $Y/%h.log", "--x", "",
        "--name", "ünï ; \\;"))
    r = verify(text, tmp_path)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert len([ln for ln in text.splitlines() if ln.startswith("Exec")]) == 1


@pytest.mark.parametrize("init", ["systemd", "launchd"])
def test_a_password_in_the_arguments_makes_the_file_0600(svc_home, init):
    r = _cli("install", "--init", init, "--", "--remote-url", "redis://:s3cret@127.0.0.1:6379")
    assert r.exit_code == 0, r.output
    (path,) = [p for p in svc_home.rglob("*") if p.suffix in (".service", ".plist")]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and b"s3cret" in path.read_bytes()
    assert "mode 0600: it holds a password" in r.output
    r = _cli("install", "--init", init, "--dry-run", "--", "--remote-url=rediss://u:s3cret@h:6380")
    assert "(mode 0600: it holds a password):" in r.output
    # Re-installed without the secret, the file is opened up again (the old mode is not kept).
    assert _cli("install", "--init", init, "--", "--ram-mb", "64").exit_code == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_holds_secret():
    assert svc.holds_secret(["--remote-url", "redis://:pw@h:1"])
    assert svc.holds_secret(["--remote-url=valkey://user:pw@h:1/0"])
    assert svc.holds_secret(["--remote-url", "rediss://h:1?password=pw"])
    assert not svc.holds_secret(["--remote-url", "redis://h:6379", "--data-dir", "/a@b"])


def test_install_reads_the_stop_timeout_of_a_config_among_the_arguments_and_keeps_their_text(svc_home, tmp_path):
    """Red-team (session 41): a `--config FILE` among the serve arguments was
    not read for stop_timeout (the unit killed a daemon given 120 s after 15),
    and an argument holding "@STOP@" had it replaced."""
    config = _write(tmp_path / "st.toml", "stop_timeout = 120\n")
    r = _cli("install", "--dry-run", "--init", "systemd", "--", "--config", str(config), "--log-file", "/var/log/kvd-@STOP@.log")
    assert r.exit_code == 0, r.output
    assert "TimeoutStopSec=125" in r.output and "/var/log/kvd-@STOP@.log" in _exec_start(r.output)


def test_install_under_a_home_no_plist_can_name_is_one_line_exit_78(svc_home, monkeypatch):
    monkeypatch.setenv("HOME", "/tmp/a\x01b")
    r = _cli("install", "--dry-run", "--init", "launchd")
    assert r.exit_code == exits.CONFIG and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("planted", ["a symlink for its lock", "a folder for its socket"])
def test_a_socket_path_that_cannot_be_used_is_exit_78_not_4(tmp_path, planted):
    """Red-team (session 41): these exited 4 ("held by another process"),
    on which a service manager restarts it for ever; a restart changes nothing."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    if planted == "a symlink for its lock":
        os.symlink("/nonexistent", run / "kvd.sock.lock")
    else:
        (run / "kvd.sock").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--endpoint", f"ipc://{run}/kvd.sock", "--data-dir", "none",
                        "--ram-mb", "16", "--shm-warm-mb", "0", "--config", str(_write(tmp_path / "kvd.toml", ""))],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == exits.CONFIG, (r.returncode, r.stderr[-500:])
