"""The vllm-mlx adapter never extends a model's life (issue 40).

A vllm-mlx process (tests/vllm_child.py, `Scheduler` driven in-process on a
tiny random-weight llama) with the adapter installed serves one request, so
its prefix cache has been built, read and written through; then the
scheduler and the model are dropped and `gc.collect()` runs. Nothing may be
left: not the model, not the scheduler, not the prefix cache -- with the
daemon up and with it down. With the daemon up, the collected cache's
queued uploads still reach it (its clients are closed, not dropped).
"""

from __future__ import annotations

import pytest

from vllm_support import requires_vllm_mlx, run_child, tokens, wait_for_puts

pytestmark = [requires_vllm_mlx, pytest.mark.slow]

PROMPT = tokens(512, seed=41) + tokens(24, seed=42)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from model_dir import build_model_dir

    return str(build_model_dir(tmp_path_factory.mktemp("llama"), hidden_size=128, num_heads=2,
                               num_kv_heads=1, head_dim=64))


def dropped(model_dir, endpoint, tmp_path, name):
    spec = {"model": model_dir, "endpoint": endpoint, "prompts": [PROMPT], "max_tokens": 4, "drop": True}
    return run_child(tmp_path, name, spec)


def test_without_kvd_vllm_mlx_frees_its_model(model_dir, tmp_path):
    """The baseline the adapter must keep: vllm-mlx alone lets go of all three."""
    got = dropped(model_dir, None, tmp_path, "plain")
    assert got["alive"] == {"model": False, "scheduler": False, "cache": False}


def test_a_dropped_scheduler_frees_model_and_cache_with_the_daemon_up(model_dir, kvd_daemon, tmp_path):
    ep = kvd_daemon.endpoint
    got = dropped(model_dir, ep, tmp_path, "up")
    assert got["installed"]
    assert got["alive"] == {"model": False, "scheduler": False, "cache": False}, got["alive"]
    assert got["caches"] == 0
    # The child has exited: whatever PUT the daemon holds came from the collected cache.
    wait_for_puts(ep, "mlx.llama.", 1, timeout=2.0)


def test_a_dropped_scheduler_frees_model_and_cache_with_the_daemon_down(model_dir, tmp_path):
    got = dropped(model_dir, f"ipc://{tmp_path}/nobody.sock", tmp_path, "down")
    assert got["installed"]
    assert got["alive"] == {"model": False, "scheduler": False, "cache": False}, got["alive"]
    assert got["caches"] == 0
