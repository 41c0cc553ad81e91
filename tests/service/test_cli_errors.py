"""The real `kvd` command line meets user mistakes and environment faults:
one line on stderr, a defined exit code, never a traceback. And settings
reach every command: an endpoint set only in kvd.toml is obeyed."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvd.cli import exits
from kvd.store import SsdStore
from support import kvd, prefix_snapshot


def assert_one_line_error(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvd: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_a_bad_endpoint_flag_is_one_line_and_exit_78(tmp_path):
    r = kvd("stats", "--endpoint", "foo://bar")
    assert_one_line_error(r, exits.CONFIG, "endpoint (from flag:--endpoint)", "foo://bar")
    r = kvd("stop", env={"KVD_ENDPOINT": "ipc://" + "x" * 200})  # longer than sun_path
    assert_one_line_error(r, exits.CONFIG, "env:KVD_ENDPOINT", "limit")


def test_a_stopped_daemon_is_said_to_be_there_but_not_answering(kvd_daemon):
    """SIGSTOPped (or too busy to take a connection): it holds its endpoint's
    lock, so the command says it does not answer, not that there is none."""
    import signal

    kvd_daemon.proc.send_signal(signal.SIGSTOP)
    try:
        r = kvd("stats", "--endpoint", kvd_daemon.endpoint, "--timeout", "0.5")
    finally:
        kvd_daemon.proc.send_signal(signal.SIGCONT)
    assert_one_line_error(r, exits.UNAVAILABLE, "does not answer", kvd_daemon.endpoint)
    assert "is `kvd serve` running" not in r.stderr


def test_export_to_an_unwritable_path_is_one_line_and_exit_1(kvd_daemon, tmp_path):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import KVCache

    tokens = list(range(40))
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, 40, 8), dtype=mx.float16), mx.zeros((1, 2, 40, 8), dtype=mx.float16))
    with kvd_daemon.client("export-ns", strict=True) as c:
        assert c.store(tokens, [cache], wait=True)
    toks = tmp_path / "ids.json"
    toks.write_text(json.dumps(tokens))
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    out = not_a_dir / "prompt.safetensors"  # a path under a regular file: unwritable, even for root
    r = kvd("export", "--namespace", "export-ns", "--tokens-file", str(toks), "-o", str(out),
                "--endpoint", kvd_daemon.endpoint)
    assert_one_line_error(r, exits.FAILED, f"cannot write {out}", "Not a directory")
    # the same command to a writable path works: the failure was the path's
    r = kvd("export", "--namespace", "export-ns", "--tokens-file", str(toks), "-o", str(tmp_path / "ok.safetensors"),
                "--endpoint", kvd_daemon.endpoint)
    assert r.returncode == 0 and (tmp_path / "ok.safetensors").exists(), r.stderr


def _read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _writable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def test_offline_gc_on_a_read_only_data_dir_is_one_line_and_exit_1(tmp_path):
    # Root ignores permission bits; run the command without the capabilities
    # that let it (a real permission check by the kernel either way).
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a folder read-only for kvd")
        prefix = (setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner,-linux_immutable", "--")
    data = tmp_path / "data"
    store = SsdStore(data, 1 << 30, background=False)
    store.close()
    _read_only(data)
    try:
        r = kvd("gc", "--data-dir", str(data), "--endpoint", f"ipc://{tmp_path}/none.sock", "--timeout", "0.5",
                    prefix=prefix)
    finally:
        _writable(data)
    assert r.returncode == exits.FAILED, r.stderr
    lines = r.stderr.splitlines()
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert lines[0] == f"kvd: no daemon answers at ipc://{tmp_path}/none.sock; collecting directly in {data} (flag:--data-dir)"
    assert len(lines) == 2 and lines[1].startswith(f"kvd: cannot collect in {data}: Permission denied"), r.stderr


def test_stats_and_stop_obey_an_endpoint_set_only_in_kvd_toml(daemon_factory, tmp_path):
    d = daemon_factory("--ram-mb", "16")
    with d.client("toml-ns", strict=True) as c:
        assert c.put(np.arange(300), prefix_snapshot(np.arange(300)))
    config_home = tmp_path / "config"
    (config_home / "kvd").mkdir(parents=True)
    (config_home / "kvd" / "kvd.toml").write_text(f'endpoint = "{d.endpoint}"\n')
    env = {"XDG_CONFIG_HOME": str(config_home)}  # the default config path; no flag, no KVD_ENDPOINT
    r = kvd("config", "--json", env=env)
    assert json.loads(r.stdout)["settings"]["endpoint"]["source"] == f"file:{config_home / 'kvd' / 'kvd.toml'}"
    r = kvd("stats", "--json", env=env)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["server"]["endpoint"] == d.endpoint and stats["namespaces"]["toml-ns"]["entries"] == 2
    assert stats["server"]["data_dir"] == str(d.data_dir)
    r = kvd("gc", "--namespace", "toml-ns", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["entries"] == 2, r.stderr
    with d.client("toml-ns", strict=True) as c:
        assert c.stats()["server"]["requests"]["GC"] == 1  # sent once, not again for an exit code
    r = kvd("stop", env=env)
    assert r.returncode == 0, r.stderr
    assert d.proc.wait(10) == 0
