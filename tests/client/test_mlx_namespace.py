"""namespace_for: same model -> same id in every process; any difference -> another id."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
from models import build, llama_model  # noqa: F401  (the fixture `llama`)

from kvd_client.mlx_lm import _format as F
from kvd_client.mlx_lm import namespace_for

from support import TESTS


CASES = {
    "llama": ("llama", "bfloat16", {}),
    "llama_q4": ("llama", "bfloat16", {"kv_bits": 4}),
    "gemma3": ("gemma3", "bfloat16", {}),
}

CHILD = """
import json, sys
import mlx.core as mx
sys.path.insert(0, {here!r})
from models import build
from kvd_client.mlx_lm import namespace_for
out = {{}}
for key, (name, dtype, kw) in {cases!r}.items():
    out[key] = namespace_for(build(name, getattr(mx, dtype)), **kw)
print(json.dumps(out))
"""


def test_same_model_same_id_in_another_process():
    here = {k: namespace_for(build(n, getattr(mx, d)), **kw) for k, (n, d, kw) in CASES.items()}
    env = dict(os.environ, PYTHONHASHSEED="12345")  # hash() would differ; hashlib must not
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(here=str(TESTS), cases=CASES)],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
    assert len(set(here.values())) == len(here)


def test_id_shape(llama):
    ns = namespace_for(llama)
    assert ns.startswith("mlx.llama.") and len(ns.encode()) <= 256
    assert ns == namespace_for(llama)


def test_every_difference_changes_the_id(llama, monkeypatch):
    base = namespace_for(llama)
    variants = {
        "seed": namespace_for(build("llama", seed=1)),
        "dtype": namespace_for(build("llama", mx.float16)),
        "kv_bits": namespace_for(llama, kv_bits=8),
        "kv_group": namespace_for(llama, kv_bits=8, kv_group_size=32),
        "kv_start": namespace_for(llama, kv_bits=8, quantized_kv_start=512),
        "max_kv_size": namespace_for(llama, max_kv_size=64),
        "weights_id": namespace_for(llama, weights_id="rev-abc"),
        "cache classes": namespace_for(build("llama_swa")),
    }
    other = build("llama")
    other.args.rope_theta = 20000.0  # config differs, weights identical
    variants["config"] = namespace_for(other)
    tweaked = build("llama")
    w = tweaked.model.layers[1].mlp.down_proj.weight
    tweaked.model.layers[1].mlp.down_proj.weight = mx.concatenate([w[:, :1] + 1, w[:, 1:]], axis=1)
    variants["one weight column"] = namespace_for(tweaked)
    monkeypatch.setattr(F, "FORMAT", F.FORMAT + 1)
    variants["format"] = namespace_for(llama)
    ids = list(variants.values())
    assert base not in ids, [k for k, v in variants.items() if v == base]
    assert len(set(ids)) == len(ids)


def test_weights_id_replaces_the_digest_but_not_the_rest(llama):
    a = namespace_for(llama, weights_id="rev-1")
    assert a == namespace_for(build("llama", seed=7), weights_id="rev-1")  # the caller vouches
    assert a != namespace_for(build("llama", mx.float16), weights_id="rev-1")  # dtype still counts


def test_namespace_for_records_the_layout(llama):
    assert F.layout_for(namespace_for(llama)) == [{"k": "kv"}, {"k": "kv"}]
    q = namespace_for(llama, kv_bits=4, kv_group_size=32)
    assert F.layout_for(q) == [{"k": "qkv", "gs": 32, "bits": 4}] * 2
    swa = F.layout_for(namespace_for(build("llama_swa")))
    assert swa[0] == {"k": "rot", "max": 32, "keep": 0} and F.needs_boundary(swa)
