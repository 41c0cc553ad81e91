"""Logits parity on real (tiny, random-weight) mlx-lm models.

Prefill P tokens, snapshot, rebuild from the Hit, continue: the logits must
be bitwise equal to continuing the original warm cache and to a cold run
that prefills the same P tokens into a fresh cache, and greedy decoding must
produce the same tokens. For attention-only models a shorter prefix is
served as well and must equal the warm cache trimmed by mlx-lm itself.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from fakes import hit_from
from models import build, continue_from, greedy, prefill, prompt

from kvd_client.mlx_lm import rebuild, snapshot

P = 150


@pytest.fixture(scope="module")
def models():
    return {}


def get_model(models, name, dtype=mx.bfloat16):
    if (name, dtype) not in models:
        models[(name, dtype)] = build(name, dtype)
    return models[(name, dtype)]


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("llama", mx.bfloat16),
        ("llama", mx.float16),
        ("llama", mx.float32),
        ("llama_swa", mx.bfloat16),
        ("gemma3", mx.bfloat16),
        ("qwen3_next", mx.float32),
        ("baichuan_m1", mx.bfloat16),
        ("llama4", mx.bfloat16),
        ("mamba", mx.bfloat16),
    ],
)
def test_rebuilt_cache_continues_bit_exact(models, name, dtype):
    model = get_model(models, name, dtype)
    tokens = prompt(P)
    warm = make_prompt_cache(model)
    prefill(model, tokens, warm)
    toks, snap = snapshot(tokens, warm)
    assert len(toks) == P
    rebuilt = rebuild(hit_from(snap, P))

    cold = make_prompt_cache(model)
    prefill(model, tokens, cold)

    got, got_toks = continue_from(model, rebuilt)
    want, want_toks = continue_from(model, warm)
    cold_rows, cold_toks = continue_from(model, cold)
    assert got == want, "rebuilt cache diverges from the warm cache"
    assert got == cold_rows, "rebuilt cache diverges from a cold prefill"
    assert got_toks == want_toks == cold_toks


@pytest.mark.parametrize("n", [64, 97, P - 1])
def test_attention_only_prefix_reuse_matches_trimmed_warm_cache(models, n):
    model = get_model(models, "llama")
    tokens = prompt(P)
    warm = make_prompt_cache(model)
    prefill(model, tokens, warm)
    _, snap = snapshot(tokens, warm)
    assert snap.meta["bnd"] is False
    rebuilt = rebuild(hit_from(snap, n, boundary=False))
    trimmed = copy.deepcopy(warm)
    for c in trimmed:
        c.trim(P - n)
    assert continue_from(model, rebuilt) == continue_from(model, trimmed)


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_quantized_kv_cache_continues_bit_exact_with_prefix(models, bits, group_size):
    model = get_model(models, "llama")
    tokens = prompt(P)
    warm = make_prompt_cache(model)
    prefill(model, tokens, warm)
    warm = [c.to_quantized(group_size=group_size, bits=bits) for c in warm]  # as mlx-lm's kv_bits does
    _, snap = snapshot(tokens, warm)
    assert {t.dtype for t, _ in snap.sliced.values()} == {"uint32", "bfloat16"}
    for n in (P, 100):
        rebuilt = rebuild(hit_from(snap, n, boundary=False))
        ref = copy.deepcopy(warm)
        for c in ref:
            c.trim(P - n)
        assert all(c.offset == n for c in rebuilt)
        assert continue_from(model, rebuilt) == continue_from(model, ref)


def test_rotating_model_after_decode_wraps(models):
    """Snapshot a sliding-window model mid-decode (ring wrapped), not right after prefill."""
    model = get_model(models, "gemma3")
    tokens = prompt(40)
    warm = make_prompt_cache(model)
    prefill(model, tokens, warm)
    decoded, _ = greedy(model, 5, warm, 20)  # window 16: the ring wraps
    seq = tokens + [5] + decoded[:-1]
    assert warm[0].offset == len(seq) and warm[0]._idx < warm[0].max_size
    _, snap = snapshot(seq, warm)
    rebuilt = rebuild(hit_from(snap, len(seq)))
    assert continue_from(model, rebuilt, first_block=[decoded[-1]]) == continue_from(
        model, warm, first_block=[decoded[-1]]
    )
