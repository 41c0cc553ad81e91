"""vllm-mlx's HTTP server (`kvd-vllm-mlx serve`) sharing a system prompt through kvd.

Real processes throughout: `kvd serve`, and vllm-mlx 0.6.0's OpenAI server
started by the kvd launcher on a tiny random-weight llama (one word = one
token, so the 512-word system prompt is two kvd chunks).
"""

from __future__ import annotations

import pytest

from model_dir import words
from vllm_support import VllmServer, requires_vllm_mlx, wait_for_puts

pytestmark = [requires_vllm_mlx, pytest.mark.slow]

SYSTEM = words(512, seed=11)
ASK_A = " " + words(20, seed=12)
ASK_B = " " + words(20, seed=13)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from model_dir import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("llama"), hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64)


def test_two_servers_share_the_system_prompt_and_a_restart_starts_warm(model_dir, kvd_daemon, tmp_path):
    ep = kvd_daemon.endpoint
    servers = []
    try:
        a = VllmServer(model_dir, tmp_path / "a", ["--cache-memory-mb", "64"], kvd_endpoint=ep).start()
        servers.append(a)
        first = a.complete(SYSTEM + ASK_A)
        wait_for_puts(ep, "mlx.llama.", 1)

        b = VllmServer(model_dir, tmp_path / "b", ["--cache-memory-mb", "64"], kvd_endpoint=ep).start()
        servers.append(b)
        cold = VllmServer(model_dir, tmp_path / "cold", ["--cache-memory-mb", "64"]).start()
        servers.append(cold)
        got, ref = b.complete(SYSTEM + ASK_B), cold.complete(SYSTEM + ASK_B)
        assert b.cached() == [512], b.log()[-3000:]
        assert cold.cached() == [0]
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]

        # A crash-restart of the first server (SIGKILL: nothing saved by
        # vllm-mlx itself; its HOME is new) starts warm from kvd.
        a.stop(kill=True)
        again = VllmServer(model_dir, tmp_path / "a2", ["--cache-memory-mb", "64"], kvd_endpoint=ep).start()
        servers.append(again)
        repeat = again.complete(SYSTEM + ASK_A)
        assert again.cached() == [512]
        assert repeat["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        for s in servers:
            s.stop()
