"""vllm-mlx's MLLM route (a tiny random-weight Qwen2-VL) with kvd behind its prefix cache.

The MLLM batch generator builds its own `MemoryAwarePrefixCache`; the adapter
backs it too, namespaced by the language model's weights. Text-only requests
on that route share a system prompt across servers through kvd. (Requests
with media are left as vllm-mlx leaves them: it keeps them out of its prefix
cache.)
"""

from __future__ import annotations

import pytest

from model_dir import words
from vllm_support import VllmServer, requires_vllm_mlx, wait_for_puts

pytestmark = [requires_vllm_mlx, pytest.mark.slow]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (.ci/install-vllm-mlx installs it)")
    from vlm_dir import build_vlm_dir

    return build_vlm_dir(tmp_path_factory.mktemp("qwen2vl"))


def test_text_requests_on_the_mllm_route_share_the_system_prompt(vlm_dir, kvd_daemon, tmp_path):
    ep, system = kvd_daemon.endpoint, words(600, seed=21)
    servers = []
    try:
        a = VllmServer(vlm_dir, tmp_path / "a", ["--cache-memory-mb", "64"], kvd_endpoint=ep).start()
        servers.append(a)
        a.chat(system, words(10, seed=22))
        wait_for_puts(ep, "mlx.qwen2_vl.", 1)
        assert "namespace mlx.qwen2_vl." in a.log()

        b = VllmServer(vlm_dir, tmp_path / "b", ["--cache-memory-mb", "64"], kvd_endpoint=ep).start()
        servers.append(b)
        cold = VllmServer(vlm_dir, tmp_path / "cold", ["--cache-memory-mb", "64"]).start()
        servers.append(cold)
        got, ref = b.chat(system, words(10, seed=23)), cold.chat(system, words(10, seed=23))
        assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    finally:
        for s in servers:
            s.stop()
    from kvd_client import Client

    with Client(ep, namespace="probe") as c:
        served = {ns: v for ns, v in c.stats()["namespaces"].items() if ns.startswith("mlx.qwen2_vl.")}
    assert len(served) == 1 and next(iter(served.values()))["tokens_served"] >= 512
