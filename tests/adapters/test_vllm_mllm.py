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
from vllm_support import VllmServer, requires_vllm_mlx, start_all, stop_all, wait_for_puts

pytestmark = [requires_vllm_mlx, pytest.mark.slow]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (./dev installs it)")
    from vlm_dir import build_vlm_dir

    return build_vlm_dir(tmp_path_factory.mktemp("qwen2vl"))


def test_text_requests_on_the_mllm_route_share_the_system_prompt(vlm_dir, kvd_daemon, tmp_path):
    ep, system = kvd_daemon.endpoint, words(600, seed=21)
    a = VllmServer(vlm_dir, tmp_path / "a", ["--cache-memory-mb", "64"], kvd_endpoint=ep)
    b = VllmServer(vlm_dir, tmp_path / "b", ["--cache-memory-mb", "64"], kvd_endpoint=ep)
    cold = VllmServer(vlm_dir, tmp_path / "cold", ["--cache-memory-mb", "64"])
    servers = [a, b, cold]
    try:
        start_all(servers)  # b asks kvd nothing before its request, which comes after a's PUT
        a.chat(system, words(10, seed=22))
        wait_for_puts(ep, "mlx.qwen2_vl.", 1)
        assert "namespace mlx.qwen2_vl." in a.log()

        got, ref = b.chat(system, words(10, seed=23)), cold.chat(system, words(10, seed=23))
        assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    finally:
        stop_all(servers)
    from kvd_client import Client

    with Client(ep, namespace="probe") as c:
        served = {ns: v for ns, v in c.stats()["namespaces"].items() if ns.startswith("mlx.qwen2_vl.")}
    assert len(served) == 1 and next(iter(served.values()))["tokens_served"] >= 512


def test_media_requests_reuse_only_with_the_same_image_and_bit_exact(vlm_dir, kvd_daemon, tmp_path):
    """vllm-mlx caches no request with media; with kvd such a request is keyed by
    its image. Same image + same text from another server: reused through the
    image, logits bit-exact with a cold server. Another image: not reused."""
    ep, system, ask = kvd_daemon.endpoint, words(300, seed=31), words(8, seed=32)
    servers = []

    def server(name, **kw):
        s = VllmServer(vlm_dir, tmp_path / name, ["--cache-memory-mb", "64"], **kw)
        servers.append(s)
        return s

    def reused(server):
        return [line for line in server.log().splitlines() if "kvd: reused" in line]

    # Each measured server answers exactly one request, so its logits log is that request's.
    first = server("first", kvd_endpoint=ep)
    same, cold = server("same", kvd_endpoint=ep, tap=True), server("cold", tap=True)
    other, cold2 = server("other", kvd_endpoint=ep, tap=True), server("cold2", tap=True)
    try:
        start_all(servers)  # none asks kvd anything before its request
        first.chat_image(system, 1, ask)
        wait_for_puts(ep, "mlx.qwen2_vl.", 1)

        got, ref = same.chat_image(system, 1, ask), cold.chat_image(system, 1, ask)
        assert len(reused(same)) == 1 and "(with media)" in reused(same)[0], same.log()[-3000:]
        n_same = len(same.logits())
        assert n_same >= 6 and same.logits()[:6] == cold.logits()[:6]
        assert got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]

        got2, ref2 = other.chat_image(system, 2, ask), cold2.chat_image(system, 2, ask)
        assert reused(other) == []  # another image: nothing through the image is shared
        assert other.logits()[:6] == cold2.logits()[:6]
        assert got2["choices"][0]["message"]["content"] == ref2["choices"][0]["message"]["content"]
        # The two images really do change the model's logits (the check above could not pass by accident).
        assert cold.logits()[0] != cold2.logits()[0]
    finally:
        stop_all(servers)
