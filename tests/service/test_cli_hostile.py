"""Hostile input to the real `kvd` command line: crafted cache files, FIFOs
where files go, absurd numbers in flags, the environment and kvd.toml. Each
command must end with one `kvd: ...` line (or click's usage error, exit 2)
and a defined exit code: never a traceback, never a hang, never a download,
never a special file replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.cli import exits
from test_cli_errors import assert_one_line_error

mx = pytest.importorskip("mlx.core")

NO_DAEMON = "ipc:///tmp/kvd-hostile-none/k.sock"  # checks below happen before any connection


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`kvd ARGS`, with a short timeout: a hang (reading a FIFO) fails the test, fast."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    return subprocess.run([sys.executable, "-m", "kvd", *map(str, args)], capture_output=True, text=True,
                          timeout=20, env={**clean, "HF_HUB_OFFLINE": "1", **(env or {})}, cwd=cwd)


def assert_usage_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == exits.USAGE, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    for w in words:
        assert w in last, (w, last)


def save_032(path: Path, states: list, classes: list[str], metadata: dict[str, str] | None = None) -> None:
    """What mlx-lm 0.32's save_prompt_cache writes, for states it would never make."""
    from mlx.utils import tree_flatten

    scalars: list = [""]
    data = {}
    for key, v in tree_flatten(states):
        if isinstance(v, mx.array):
            data[key] = v
        elif isinstance(v, (int, float)):
            scalars.append((key, "scalar"))
            data[key] = mx.array(v)
        elif isinstance(v, str):
            scalars.append((key, "string"))
            data[key] = mx.array([ord(ch) for ch in v])
        elif v is None:
            scalars.append((key, "none"))
            data[key] = mx.array([])
    mx.save_safetensors(str(path), data, dict(tree_flatten([metadata or {}, classes, scalars])))


T = 6
TOKENS = json.dumps(list(range(1, T + 1)))


def _k(rows: int = T):
    return mx.zeros((1, 2, rows, 8), dtype=mx.float16)


CRAFTED = {
    "offset a string": ([[_k(), _k(), "abc"]], ["KVCache"], "offset"),
    "offset None": ([[_k(), _k(), None]], ["KVCache"], "offset"),
    "keys a number": ([[5, _k(), T]], ["KVCache"], "keys"),
    "quantized side of 2 arrays": ([[[_k(), _k()], [_k(), _k()], T, 64, 8]], ["QuantizedKVCache"], "3 arrays"),
    "rotating _idx a string": ([[_k(), _k(), T, 0, 64, "x"]], ["RotatingKVCache"], "_idx"),
    "arrays entry a string": ([[["s", None], None, None]], ["ArraysCache"], "entry 0"),
    "values with fewer rows": ([[_k(), _k(3), T]], ["KVCache"], "disagree"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_read_refuses_a_crafted_layer_state(tmp_path, case):
    from kvd_client.mlx_lm_files import CacheFileError, read

    states, classes, word = CRAFTED[case]
    f = tmp_path / "crafted.safetensors"
    save_032(f, states, classes, {"kvd_tokens": TOKENS})
    with pytest.raises(CacheFileError, match=f"layer 0 .*{word}"):
        read(f)


def test_import_of_a_crafted_layer_state_is_refused_in_one_line(tmp_path):
    f = tmp_path / "crafted.safetensors"
    save_032(f, *CRAFTED["offset a string"][:2], {"kvd_tokens": TOKENS})
    r = run("import", f, "--namespace", "x", "--endpoint", NO_DAEMON, "--timeout", "1")
    assert_one_line_error(r, exits.FAILED, "layer 0 (KVCache)", "offset")


def test_import_of_a_crafted_031_file_is_refused_in_one_line(tmp_path):
    from mlx.utils import tree_flatten

    f = tmp_path / "q031.safetensors"
    meta = {"1.kvd_tokens": TOKENS, **{a: b for a, b in tree_flatten([[["6", "64", "8"]], {}, ["QuantizedKVCache"]])}}
    mx.save_safetensors(str(f), {"0.0": _k(), "0.1": _k()}, meta)  # a side is one array, not (data, scales, biases)
    r = run("import", f, "--namespace", "x", "--endpoint", NO_DAEMON, "--timeout", "1")
    assert_one_line_error(r, exits.FAILED, "QuantizedKVCache", "3 arrays")


def test_a_model_named_by_the_file_is_never_downloaded(tmp_path):
    f = tmp_path / "c.safetensors"
    save_032(f, [[_k(), _k(), T]], ["KVCache"], {"model": "mlx-community/Some-Model-4bit", "kvd_tokens": TOKENS})
    r = run("import", f, "--endpoint", NO_DAEMON, "--timeout", "1", cwd=tmp_path)
    assert_one_line_error(r, exits.FAILED, "mlx-community/Some-Model-4bit", "not a local model directory", "metadata")
    # --model must be a directory too: a bad flag.
    r = run("import", f, "--model", "mlx-community/Some-Model-4bit", "--endpoint", NO_DAEMON, cwd=tmp_path)
    assert_usage_error(r, "--model", "not a local model directory")


def test_fifos_are_refused_where_files_are_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    good = tmp_path / "c.safetensors"
    save_032(good, [[_k(), _k(), T]], ["KVCache"])
    r = run("import", fifo, "--namespace", "x", "--endpoint", NO_DAEMON)
    assert_usage_error(r, "not a regular file")
    for args in (["import", good], ["explain"], ["export", "-o", tmp_path / "out.safetensors"]):
        r = run(*args, "--namespace", "x", "--tokens-file", fifo, "--endpoint", NO_DAEMON)
        assert_usage_error(r, "--tokens-file", "not a regular file")


def test_export_never_replaces_a_fifo_or_a_symlink(kvd_daemon, tmp_path):
    from mlx_lm.models.cache import KVCache

    tokens = list(range(1, 33))
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, 32, 8), dtype=mx.float16), mx.ones((1, 2, 32, 8), dtype=mx.float16))
    with kvd_daemon.client("hostile-ns", strict=True) as c:
        assert c.store(tokens, [cache], wait=True)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(tokens))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target"
    target.write_text("keep me")
    link = tmp_path / "link"
    link.symlink_to(target)
    for out, word in ((fifo, "not a regular file"), (link, "symlink")):
        r = run("export", "--namespace", "hostile-ns", "--tokens-file", ids, "-o", out, "--endpoint", kvd_daemon.endpoint)
        assert_one_line_error(r, exits.FAILED, str(out), word)
    assert fifo.is_fifo() and link.is_symlink() and target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "ids.json", "link", "target"]  # no temp file left


def test_tokens_that_do_not_parse_are_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    r = run("explain", "--namespace", "x", "--tokens-file", deep, "--endpoint", NO_DAEMON)
    assert_usage_error(r, "--tokens-file", "nested too deeply")
    for meta in ("abc", "[-1, 2, 3, 4, 5, 6]"):
        f = tmp_path / "m.safetensors"
        save_032(f, [[_k(), _k(), T]], ["KVCache"], {"kvd_tokens": meta})
        r = run("import", f, "--namespace", "x", "--endpoint", NO_DAEMON, "--timeout", "1")
        assert_one_line_error(r, exits.FAILED, "file metadata kvd_tokens")


def test_overflowing_numbers_in_kvd_toml_are_config_errors(tmp_path):
    for body, word in (('[quota."x"]\nssd_gb = inf\n', "ssd_gb"),
                       ('[quota."x"]\nram_mb = 1' + "0" * 30 + "\n", "ram_mb"),
                       ("ssd_gb = 1" + "0" * 400 + "\n", "finite"),
                       ("timeout = 1" + "0" * 400 + "\n", "finite")):
        toml = tmp_path / "kvd.toml"
        toml.write_text(body)
        r = run("stats", "--config", toml, "--endpoint", NO_DAEMON)
        assert_one_line_error(r, exits.CONFIG, word)
        assert len(r.stderr) < 300  # not the 400 digits back


@pytest.mark.parametrize("args, env, word", [
    (["--timeout", "3000000"], {}, "timeout (from flag:--timeout)"),
    ([], {"KVD_TIMEOUT": "1e12"}, "timeout (from env:KVD_TIMEOUT)"),
    (["--ram-mb", str(10**15)], {}, "ram_mb"),
    (["--stop-timeout", "1e300"], {}, "stop_timeout"),
])
def test_settings_past_their_bounds_are_config_errors(args, env, word):
    r = run("config", *args, env=env)  # `kvd config` says "kvd config: ..."
    assert r.returncode == exits.CONFIG and r.stdout == "", (r.returncode, r.stderr)
    (line,) = r.stderr.splitlines()
    assert line.startswith("kvd config: ") and word in line and "<=" in line, line


@pytest.mark.parametrize("flag, value", [
    ("--ssd-gb", "nan"), ("--ram-mb", str(10**20)), ("--older-than", "nan"),
])
def test_gc_refuses_absurd_numbers(tmp_path, flag, value):
    r = run("gc", flag, value, "--endpoint", NO_DAEMON, "--timeout", "1", "--data-dir", tmp_path)
    assert_usage_error(r, flag)


def test_adapter_call_backstop_turns_a_bad_cache_into_one_line(capsys):
    from kvd.cli.model_args import adapter_call

    def boom():
        raise TypeError("'str' object cannot be interpreted as an integer")

    with pytest.raises(SystemExit) as e:
        adapter_call(boom)
    assert e.value.code == exits.FAILED
    assert capsys.readouterr().err.startswith("kvd: the cache cannot be stored: TypeError")
