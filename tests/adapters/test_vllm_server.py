"""vllm-mlx's HTTP server (`kvd-vllm-mlx serve`) sharing a system prompt through kvd.

Real processes throughout: `kvd serve`, and vllm-mlx 0.6.0's OpenAI server
started by the kvd launcher on a tiny random-weight llama (one word = one
token, so the 512-word system prompt is two kvd chunks).
"""

from __future__ import annotations

import signal
import time

import pytest

from model_dir import words
from vllm_support import VllmServer, requires_vllm_mlx, start_all, stop_all, wait_for_puts

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
    a = VllmServer(model_dir, tmp_path / "a", ["--cache-memory-mb", "64"], kvd_endpoint=ep)
    b = VllmServer(model_dir, tmp_path / "b", ["--cache-memory-mb", "64"], kvd_endpoint=ep)
    cold = VllmServer(model_dir, tmp_path / "cold", ["--cache-memory-mb", "64"])
    servers = [a, b, cold]
    try:
        start_all(servers)  # b asks kvd nothing before its request, which comes after a's PUT
        first = a.complete(SYSTEM + ASK_A)
        wait_for_puts(ep, "mlx.llama.", 1)

        got, ref = b.complete(SYSTEM + ASK_B), cold.complete(SYSTEM + ASK_B)
        assert b.cached() == [512], b.log()[-3000:]
        assert cold.cached() == [0]
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]

        # A crash-restart of the first server (SIGKILL: nothing saved by
        # vllm-mlx itself; its HOME is new) starts warm from kvd.
        a.stop(kill=True)
        again = VllmServer(model_dir, tmp_path / "a2", ["--cache-memory-mb", "64", "--kvd-timeout", "60"],
                           kvd_endpoint=ep).start()
        servers.append(again)
        repeat = again.complete(SYSTEM + ASK_A)
        assert again.cached() == [512]
        assert repeat["choices"][0]["text"] == first["choices"][0]["text"]

        # SIGTERM (a service manager's stop) finishes the uploads queued then,
        # within the kvd timeout. Held back here by a stopped daemon until the
        # server's HTTP side has shut down, the last one lands once it answers.
        # (uvicorn hands SIGTERM back to the default action after its shutdown:
        # the process died with the upload, exit -15, no atexit.)
        puts = _puts(ep)
        again.complete(SYSTEM + ASK_A, max_tokens=12)  # one upload queued (after one LOOKUP, answered)
        kvd_daemon.proc.send_signal(signal.SIGSTOP)
        try:
            again.proc.send_signal(signal.SIGTERM)
            _wait_for(lambda: "Finished server process" in again.log() or again.proc.poll() is not None)
        finally:
            kvd_daemon.proc.send_signal(signal.SIGCONT)
        assert again.proc.wait(60) == 0, again.log()[-3000:]
        assert _puts(ep) == puts + 1
    finally:
        stop_all(servers)


def _puts(endpoint: str) -> int:
    from kvd_client import Client

    with Client(endpoint, namespace="probe", timeout=5.0) as c:
        return sum(v.get("puts", 0) for ns, v in c.stats()["namespaces"].items() if ns.startswith("mlx.llama."))


def _wait_for(done, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
