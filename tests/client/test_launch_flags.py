"""The kvd flags of both server launchers (kvd_client._launch): what they
parse, what they hand on to the stock server untouched, and their help."""

from __future__ import annotations

import pytest

from kvd_client._launch import KvdFlags, read_kvd_flags
from kvd_client.mlx_lm_server import launcher as mlx_launcher
from kvd_client.vllm_mlx import launcher as vllm_launcher

LAUNCHERS = [
    pytest.param(mlx_launcher, "mlx_lm.server", "run the stock mlx-lm server without kvd", id="mlx_lm_server"),
    pytest.param(vllm_launcher, "vllm-mlx", "run vllm-mlx without kvd", id="vllm_mlx"),
]


@pytest.mark.parametrize("launcher, upstream, without", LAUNCHERS)
def test_kvd_flags_are_taken_and_the_rest_passes_in_order(launcher, upstream, without, monkeypatch):
    monkeypatch.delenv("KVD_ENDPOINT", raising=False)
    argv = ["serve", "m", "--kvd-timeout", "2.5", "--port", "8", "--kvd-e", "x", "--no-kvd", "--kvd-endpoint=ipc:///a"]
    flags, rest = read_kvd_flags(launcher._parser(), argv, upstream=upstream)
    assert flags == KvdFlags(enabled=False, endpoint="ipc:///a", timeout=2.5)
    assert rest == ["serve", "m", "--port", "8", "--kvd-e", "x"]  # no abbreviations: --kvd-e is upstream's


@pytest.mark.parametrize("launcher, upstream, without", LAUNCHERS)
def test_defaults_come_from_the_environment_when_the_parser_is_made(launcher, upstream, without, monkeypatch):
    monkeypatch.setenv("KVD_ENDPOINT", "ipc:///from-env")
    flags, rest = read_kvd_flags(launcher._parser(), ["--model", "m"], upstream=upstream)
    assert flags == KvdFlags(enabled=True, endpoint="ipc:///from-env", timeout=1.0) and rest == ["--model", "m"]
    monkeypatch.delenv("KVD_ENDPOINT")
    assert read_kvd_flags(launcher._parser(), [], upstream=upstream)[0].endpoint is None


@pytest.mark.parametrize("launcher, upstream, without", LAUNCHERS)
def test_help_shows_the_kvd_flags_then_hands_help_on(launcher, upstream, without, capsys):
    flags, rest = read_kvd_flags(launcher._parser(), ["-h"], upstream=upstream)
    assert rest == ["-h"] and flags.enabled  # the stock server prints its own help after ours
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    for text in ("--kvd-endpoint", "kvd daemon endpoint (default: $KVD_ENDPOINT or the per-user socket)",
                 "--kvd-timeout", "seconds per daemon call (default: 1.0)", f"--no-kvd {without}",
                 f"{upstream} flags follow."):
        assert text in out, out
    assert read_kvd_flags(launcher._parser(), ["--port", "8"], upstream=upstream)[1] == ["--port", "8"]
    assert capsys.readouterr().out == ""  # no help asked, none printed
