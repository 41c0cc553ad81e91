"""vllm-mlx's standard scheduler with kvd as its shared prefix cache and cold tier.

Each test runs real vllm-mlx processes (`Scheduler` driven in-process, no
HTTP; tests/vllm_child.py) on a tiny random-weight llama against a real
`kvd serve`. The system prompt is 512 tokens, two kvd chunks, so a RAM hit
in the storing process and a kvd hit in another reuse exactly the same
prefix and their logits can be compared bit for bit.
"""

from __future__ import annotations

import logging

import pytest

from vllm_support import requires_vllm_mlx, run_child, run_child_aside, tokens

pytestmark = [requires_vllm_mlx, pytest.mark.slow]

SYSTEM = tokens(512, seed=1)
USER_A = tokens(24, seed=2)
USER_B = tokens(24, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from model_dir import build_model_dir

    # head_dim 64: --kv-cache-quantization's group size must divide it.
    return str(build_model_dir(tmp_path_factory.mktemp("llama"), hidden_size=128, num_heads=2,
                               num_kv_heads=1, head_dim=64))


def spec(model_dir, endpoint, prompts, **config):
    return {"model": model_dir, "endpoint": endpoint, "prompts": prompts, "max_tokens": 6, "config": config}


def test_a_second_process_reuses_the_system_prompt_bit_exact(model_dir, kvd_daemon, tmp_path):
    ep = kvd_daemon.endpoint
    cold = run_child_aside(tmp_path, "cold", spec(model_dir, None, [SYSTEM + USER_B]))
    first = run_child(tmp_path, "first", spec(model_dir, ep, [SYSTEM + USER_A]))
    second = run_child(tmp_path, "second", spec(model_dir, ep, [SYSTEM + USER_B]))
    cold = cold.result()

    assert first["installed"] and first["kvd"]["cache"].get("kvd_stores", 0) >= 1
    got, ref = second["results"][0], cold["results"][0]
    assert (got["cached"], got["hit"]) == (512, "prefix")
    assert second["kvd"]["cache"]["kvd_hits"] == 1 and second["kvd"]["cache"]["kvd_tokens"] == 512
    assert cold["results"][0]["cached"] == 0
    assert got["tokens"] == ref["tokens"]
    assert got["logits"] == ref["logits"]  # float32 bytes of every step
    assert ("KVCache" in second["entries"][0][1]) and second["entries"][0][0] == 512


def test_quantized_kv_comes_back_quantized_and_bit_exact_with_the_warm_cache(model_dir, kvd_daemon, tmp_path):
    ep = kvd_daemon.endpoint
    # The first process answers USER_B from its own RAM (the warm cache), the
    # second from kvd; both reuse the same 512 quantized tokens.
    warm = run_child(tmp_path, "warm", spec(model_dir, ep, [SYSTEM + USER_A, SYSTEM + USER_B], kv_cache_quantization=True))
    other = run_child(tmp_path, "other", spec(model_dir, ep, [SYSTEM + USER_B], kv_cache_quantization=True))

    w, o = warm["results"][1], other["results"][0]
    assert (w["cached"], o["cached"]) == (512, 512)
    assert other["kvd"]["cache"]["kvd_hits"] == 1
    restored = [layers for n, layers in other["entries"] if n == 512]
    assert restored == [["_QuantizedCacheWrapper", "_QuantizedCacheWrapper"]]
    assert o["tokens"] == w["tokens"]
    assert o["logits"] == w["logits"]
    # Quantized entries live in a namespace of their own.
    spaces = other["kvd"]["clients"]
    assert len(spaces) == 2 and sum(c.get("fetch_hit", 0) for c in spaces.values()) == 1


def test_a_hit_too_big_for_vllm_ram_is_fetched_once_then_only_what_fits(model_dir, kvd_daemon, tmp_path):
    """kvd holds 4,096 tokens of a prompt (~2 MiB of KV); vllm-mlx's cache in
    the second process is 1 MiB and refuses that entry. The refusal is
    remembered: the next request fetches the prefix that fits and reuses it
    (before, every request fetched the whole hit again and threw it away)."""
    ep = kvd_daemon.endpoint
    long = tokens(4096, seed=4)
    cold = run_child_aside(tmp_path, "cold", spec(model_dir, None, [long + USER_A], cache_memory_mb=1))
    run_child(tmp_path, "big", spec(model_dir, ep, [long + USER_A]))
    small = run_child(tmp_path, "small", spec(model_dir, ep, [long + USER_B, long + USER_A], cache_memory_mb=1))
    cold = cold.result()

    counted = small["kvd"]["cache"]
    assert counted["kvd_not_admitted"] == 1 and counted["kvd_hits"] == 1, counted
    first, second = small["results"]
    assert first["cached"] == 0 and 0 < second["cached"] < 4096 and second["cached"] % 256 == 0
    assert second["tokens"] == cold["results"][0]["tokens"]


def test_a_daemon_that_is_down_costs_a_miss_not_an_error(model_dir, tmp_path):
    dead = f"ipc://{tmp_path}/nobody.sock"
    cold = run_child_aside(tmp_path, "cold", spec(model_dir, None, [SYSTEM + USER_A, SYSTEM + USER_B]))
    got = run_child(tmp_path, "down", spec(model_dir, dead, [SYSTEM + USER_A, SYSTEM + USER_B]))
    cold = cold.result()
    assert got["installed"]
    assert [r["tokens"] for r in got["results"]] == [r["tokens"] for r in cold["results"]]
    assert [r["cached"] for r in got["results"]] == [0, 512]  # vllm-mlx's own RAM cache still works
    assert got["kvd"]["cache"].get("kvd_hits", 0) == 0 and "kvd_errors" not in got["kvd"]["cache"]
    said = [line for line in got["log"].splitlines() if "kvd:" in line and "answering" in line]
    assert len(said) == 1, got["log"]


def test_missing_internals_leave_vllm_mlx_untouched(monkeypatch, caplog):
    import vllm_mlx.memory_cache as mc
    import vllm_mlx.scheduler as sched

    import kvd_client.vllm_mlx as kv_vllm

    original = sched.MemoryAwarePrefixCache
    # Another vllm-mlx version without the quantized-entry class:
    monkeypatch.delattr(mc, "_QuantizedCacheWrapper")
    with caplog.at_level(logging.WARNING, logger="kvd_client.vllm_mlx"):
        assert kv_vllm.install("ipc:///nonexistent/kvd.sock") is False
    assert sched.MemoryAwarePrefixCache is original and mc.MemoryAwarePrefixCache is original
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "vllm_mlx.memory_cache._QuantizedCacheWrapper" in lines[0]
