"""Tiny random-weight mlx-lm models, built offline, for kvd's mlx tests.

Each builder seeds mlx's RNG, so the same name and dtype give bit-identical
weights in every process (the cross-process tests rely on it). Sizes are
chosen so a 300-token prefill takes well under a second on two CPU cores
while still exercising every cache class mlx-lm 0.32 has:

    name          cache layout per layer
    ------------  ----------------------------------------------------
    llama         KVCache x 2
    llama_swa     RotatingKVCache(window 32), KVCache, RotatingKVCache
    gemma3        RotatingKVCache(window 16) x 2, KVCache (pattern 3)
    qwen3_next    ArraysCache(2) x 3 (fp32 conv + recurrent), KVCache
    baichuan_m1   CacheList(ArraysCache, RotatingKVCache | KVCache) x 2
    llama4        ChunkedKVCache(chunk 32) x 3, KVCache
    mamba         ArraysCache(2) x 2 (pure recurrent: nothing sliced at all)
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

VOCAB = 128

BUILDERS = {}


def builder(fn):
    BUILDERS[fn.__name__] = fn
    return fn


def build(name: str, dtype=mx.bfloat16, seed: int = 0) -> nn.Module:
    """A tiny model of kind `name`, its weights cast to `dtype`, seeded with `seed`."""
    mx.random.seed(seed)
    model = BUILDERS[name]()
    if name == "qwen3_next":
        dtype = mx.float32  # its gated-delta kernels want fp32 on CPU
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", name="llama")
def llama_model() -> nn.Module:
    """Fixture `llama`: the tiny llama, built once per test module that imports
    this (`from models import llama_model  # noqa: F401`)."""
    return build("llama")


@builder
def llama():
    from mlx_lm.models import llama as m

    return m.Model(
        m.ModelArgs(
            model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
            head_dim=64,  # so KV quantization with group size 64 applies
        )
    )


@builder
def llama_swa():
    from mlx_lm.models import llama as m

    return m.Model(
        m.ModelArgs(
            model_type="llama", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
            head_dim=32, sliding_window=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    )


@builder
def gemma3():
    from mlx_lm.models import gemma3_text as m

    return m.Model(
        m.ModelArgs(
            model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=VOCAB,
            query_pre_attn_scalar=32, sliding_window=16, sliding_window_pattern=3,
        )
    )


@builder
def qwen3_next():
    from mlx_lm.models import qwen3_next as m

    return m.Model(
        m.ModelArgs(
            model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
            num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            num_experts=0, num_experts_per_tok=1, decoder_sparse_step=1,
            shared_expert_intermediate_size=128, mlp_only_layers=[0, 1, 2, 3],
            moe_intermediate_size=64, rms_norm_eps=1e-6, vocab_size=VOCAB,
            num_key_value_heads=2, rope_theta=10000.0, partial_rotary_factor=0.5,
            max_position_embeddings=4096, head_dim=32, full_attention_interval=4,
        )
    )


@builder
def baichuan_m1():
    from mlx_lm.models import baichuan_m1 as m

    return m.Model(
        m.ModelArgs(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
            sliding_window=32, sliding_window_layers=[0], conv_window=2, rms_norm_eps=1e-5,
        )
    )


@builder
def llama4():
    from mlx_lm.models import llama4 as m

    text = dict(
        attention_bias=False, attention_chunk_size=32, head_dim=16, hidden_size=64,
        interleave_moe_layer_step=1000, intermediate_size=128, intermediate_size_mlp=128,
        max_position_embeddings=4096, model_type="llama4_text", num_attention_heads=4,
        num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2,
        num_local_experts=1, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0,
        use_qk_norm=True, vocab_size=VOCAB,
    )
    return m.Model(m.ModelArgs(model_type="llama4", text_config=text))


@builder
def mamba():
    from mlx_lm.models import mamba as m

    return m.Model(
        m.ModelArgs(
            model_type="mamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, state_size=8,
            num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8,
        )
    )


def prompt(n: int, seed: int = 1) -> list[int]:
    """`n` deterministic token ids in [0, VOCAB)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def prefill(model: nn.Module, tokens: list[int], cache: list, step: int = 64) -> mx.array:
    """Feed `tokens` through `model` into `cache` in steps; the last logits row (evaluated)."""
    logits = None
    for s in range(0, len(tokens), step):
        logits = model(mx.array(tokens[s : s + step])[None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    return logits[0, -1]


def greedy(model: nn.Module, first: int, cache: list, n: int) -> tuple[list[int], list[mx.array]]:
    """Decode `n` tokens greedily from `first`; the tokens and each step's logits."""
    out, rows, tok = [], [], first
    for _ in range(n):
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        mx.eval(logits)
        rows.append(logits)
        tok = int(mx.argmax(logits).item())
        out.append(tok)
    return out, rows


# -- comparing and continuing ------------------------------------------------

def raw(x):
    """(dtype, shape, bytes) of an mlx array: bit-exact identity, NaN-safe."""
    dt = str(x.dtype)
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    a = np.array(x)
    return dt, a.shape, a.tobytes()


def same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return raw(a) == raw(b)


CONTINUE = prompt(9, seed=7)


def continue_from(model, cache, first_block=CONTINUE, decode=6):
    """Feed a multi-token block, then decode greedily: (all logits rows, tokens)."""
    logits = model(mx.array(first_block)[None], cache=cache)
    mx.eval(logits)
    toks, rows = greedy(model, int(mx.argmax(logits[0, -1]).item()), cache, decode)
    return [raw(logits)] + [raw(r) for r in rows], toks
