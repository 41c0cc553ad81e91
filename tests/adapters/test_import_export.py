"""`kvd import` / `kvd export` against a real daemon, for every cache class.

Files are written by the installed mlx-lm's own `save_prompt_cache` (0.32
layout), by `save_031` below, which writes what mlx-lm 0.31's
`save_prompt_cache` wrote (sliced `state`, string `meta_state`, metadata
`[cache_info, metadata, cache_classes]`), and by mlx-lm 0.31.3 itself
(installed into the repo's .cache by the test), which must agree with
`save_031` to the byte. Everything is compared bit for bit
through `snapshot` (host bytes of every valid row and scalar).
"""

from __future__ import annotations

import json
from functools import cache as memoize

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as C

import kvd.cli.transfer  # noqa: F401  (registers import/export until the lead does)
from kvd.cli import main as cli
from kvd_client.mlx_lm import _format as F
from kvd_client.mlx_lm import namespace_for, rebuild, snapshot
from kvd_client.mlx_lm_files import read
from models import build, prefill, prompt
from support import TESTS

N_TOKENS = 100

CASES = {
    # name: (builder, cache transform, namespace_for options)
    "kv": ("llama", None, {}),
    "concat": ("llama", "concat", {}),
    "quantized": ("llama", "quantize", {"kv_bits": 8, "kv_group_size": 64}),
    "rotating": ("llama_swa", None, {}),
    "rotating_gemma": ("gemma3", None, {}),
    "arrays": ("qwen3_next", None, {}),
    "cachelist": ("baichuan_m1", None, {}),
    "chunked": ("llama4", None, {}),
}


def _cache(case: str):
    name, how, opts = CASES[case]
    model = build(name)
    if how == "concat":
        cache = [C.ConcatenateKVCache() for _ in model.layers]
    else:
        cache = C.make_prompt_cache(model)
    toks = prompt(N_TOKENS, seed=3)
    prefill(model, toks, cache, step=48)
    if how == "quantize":
        cache = [c.to_quantized(group_size=64, bits=8) for c in cache]
        mx.eval([c.state for c in cache])
    return model, cache, toks, opts


# -- the 0.31 writer, as mlx-lm 0.31 did it ---------------------------------------
def _state_031(c):
    t = type(c).__name__
    if t in ("KVCache", "ChunkedKVCache"):
        if c.offset == c.keys.shape[2]:
            return c.keys, c.values
        return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    if t == "ConcatenateKVCache":
        return c.keys, c.values
    if t == "QuantizedKVCache":
        if c.offset == c.keys[0].shape[2]:
            return c.keys, c.values
        return tree_map(lambda x: x[..., : c.offset, :], (c.keys, c.values))
    if t == "RotatingKVCache":
        if c.offset < c.keys.shape[2]:
            return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        return c.keys, c.values
    if t == "ArraysCache":
        return c.cache
    if t == "CacheList":
        return [_state_031(s) for s in c.caches]
    raise AssertionError(t)


def _meta_031(c):
    t = type(c).__name__
    if t == "QuantizedKVCache":
        return tuple(map(str, (c.offset, c.group_size, c.bits)))
    if t == "RotatingKVCache":
        return tuple(map(str, (c.keep, c.max_size, c.offset, c._idx)))
    if t == "ChunkedKVCache":
        return tuple(map(str, (c.chunk_size, c.start_position)))
    if t == "CacheList":
        return ([type(s).__name__ for s in c.caches], [_meta_031(s) for s in c.caches])
    return ""


def save_031(path, cache, metadata=None):
    cache_data = dict(tree_flatten([_state_031(c) for c in cache]))
    cache_info = [_meta_031(c) for c in cache]
    cache_classes = [type(c).__name__ for c in cache]
    cache_metadata = dict(tree_flatten([cache_info, metadata or {}, cache_classes]))
    mx.save_safetensors(str(path), cache_data, cache_metadata)


# -- checks ---------------------------------------------------------------------------
def assert_same_cache(tokens, got, want):
    """Bit-exact: every valid row, every boundary tensor, every scalar."""
    (t1, s1), (t2, s2) = snapshot(tokens, got), snapshot(tokens, want)
    assert list(t1) == list(t2)
    assert s1.meta == s2.meta
    assert s1.boundary_meta == s2.boundary_meta
    assert sorted(s1.sliced) == sorted(s2.sliced) and sorted(s1.boundary) == sorted(s2.boundary)
    for name, (h, axis) in s1.sliced.items():
        h2, axis2 = s2.sliced[name]
        assert axis == axis2 and h.dtype == h2.dtype and h.shape == h2.shape, name
        assert h.array.tobytes() == h2.array.tobytes(), name
    for name, h in s1.boundary.items():
        h2 = s2.boundary[name]
        assert h.dtype == h2.dtype and h.shape == h2.shape, name
        assert h.array.tobytes() == h2.array.tobytes(), name


def _run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return result


def _fetch_all(daemon, namespace, tokens, layers):
    with daemon.client(namespace) as c:
        hit = c.get(tokens, need_boundary=F.needs_boundary(layers))
    assert hit is not None and hit.n == len(tokens)
    return rebuild(hit)


@pytest.mark.parametrize("layout", ["0.32", "0.31"])
@pytest.mark.parametrize("case", list(CASES))
def test_import_then_export_bit_exact(kvd_daemon, tmp_path, case, layout):
    model, cache, toks, opts = _cache(case)
    namespace = namespace_for(model, **opts)
    if case == "concat":  # its own layout: not the namespace of the model's KVCache
        namespace = f"test-concat-{layout}"
    src = tmp_path / "in.safetensors"
    if layout == "0.32":
        C.save_prompt_cache(str(src), cache, {"note": "mine"})
    else:
        save_031(src, cache, {"note": "mine"})
    cf = read(src)
    assert cf.layout == layout and cf.metadata == {"note": "mine"}
    assert_same_cache(toks, cf.cache, cache)

    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(toks))
    r = _run("import", src, "--endpoint", kvd_daemon.endpoint, "--namespace", namespace, "--tokens-file", tokens_file, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["tokens"] == N_TOKENS

    layers = [F.spec_of(c) for c in cache]
    assert_same_cache(toks, _fetch_all(kvd_daemon, namespace, toks, layers), cache)

    out = tmp_path / "out.safetensors"
    r = _run("export", "--endpoint", kvd_daemon.endpoint, "--namespace", namespace, "--tokens-file", tokens_file, "-o", out)
    assert r.exit_code == 0, r.output
    loaded, meta = C.load_prompt_cache(str(out), return_metadata=True)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert_same_cache(toks, loaded, cache)
    assert json.loads(meta["kvd_tokens"]) == toks and meta["kvd_namespace"] == namespace


def test_model_dir_file_from_cache_prompt_style_metadata(kvd_daemon, tmp_path):
    """A file naming its model (as mlx_lm.cache_prompt writes it) lands in the model's namespace."""
    from mlx_lm.utils import load

    from model_dir import build_model_dir

    path = build_model_dir(tmp_path / "model")
    model, tokenizer = load(str(path))
    text = "kan lor mis " * 30
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False, continue_final_message=True)
    cache = C.make_prompt_cache(model)
    prefill(model, ids, cache)
    src = tmp_path / "prompt.safetensors"
    C.save_prompt_cache(str(src), cache, {"model": str(path), "tokenizer_config": "{}"})
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(text)

    # No tokens in the file and none given: a usage error.
    r = _run("import", src, "--endpoint", kvd_daemon.endpoint)
    assert r.exit_code == 2, r.output
    # The wrong number of tokens: refused.
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 3")
    r = _run("import", src, "--endpoint", kvd_daemon.endpoint, "--tokens-file", bad)
    assert r.exit_code == 1 and "holds" in r.output, r.output

    r = _run("import", src, "--endpoint", kvd_daemon.endpoint, "--prompt-file", prompt_file, "--json")
    assert r.exit_code == 0, r.output
    namespace = namespace_for(model)
    assert json.loads(r.output)["namespace"] == namespace
    with kvd_daemon.client(namespace) as c:
        got, n = c.fetch(list(ids) + [7])
    assert n == len(ids)
    assert_same_cache(ids, got, cache)

    # Export by model path; the file re-imports by its own metadata alone.
    tokens_file = tmp_path / "ids.txt"
    tokens_file.write_text(" ".join(map(str, ids)))
    out = tmp_path / "out.safetensors"
    r = _run("export", "--endpoint", kvd_daemon.endpoint, "--model", path, "--tokens-file", tokens_file, "-o", out)
    assert r.exit_code == 0, r.output
    assert_same_cache(ids, C.load_prompt_cache(str(out)), cache)
    r = _run("gc", "--endpoint", kvd_daemon.endpoint, "--namespace", namespace)
    assert r.exit_code == 0, r.output
    r = _run("import", out, "--endpoint", kvd_daemon.endpoint)
    assert r.exit_code == 0, r.output
    with kvd_daemon.client(namespace) as c:
        assert c.probe(ids).n == len(ids)


def test_cache_of_another_model_is_refused(kvd_daemon, tmp_path):
    _, cache, toks, _ = _cache("kv")
    src = tmp_path / "kv.safetensors"
    C.save_prompt_cache(str(src), cache)
    tokens_file = tmp_path / "t.json"
    tokens_file.write_text(json.dumps(toks))
    other = namespace_for(build("llama_swa"))  # records a windowed layout for that namespace
    r = _run("import", src, "--endpoint", kvd_daemon.endpoint, "--namespace", other, "--tokens-file", tokens_file)
    assert r.exit_code == 1 and "does not fit" in r.output, r.output


def test_export_miss_and_no_daemon(kvd_daemon, daemon_factory, tmp_path):
    tokens_file = tmp_path / "t.txt"
    tokens_file.write_text("1 2 3 4")
    out = tmp_path / "o.safetensors"
    r = _run("export", "--endpoint", kvd_daemon.endpoint, "--namespace", "nothing-here", "--tokens-file", tokens_file, "-o", out)
    assert r.exit_code == 1 and not out.exists(), r.output
    absent = daemon_factory(start=False)
    r = _run("export", "--endpoint", absent.endpoint, "--timeout", "1", "--namespace", "x", "--tokens-file", tokens_file, "-o", out)
    assert r.exit_code == 3, r.output


def test_not_a_prompt_cache_file(kvd_daemon, tmp_path):
    junk = tmp_path / "junk.safetensors"
    mx.save_safetensors(str(junk), {"w": mx.zeros((2, 2))}, {"format": "mlx"})
    r = _run("import", junk, "--endpoint", kvd_daemon.endpoint, "--namespace", "x", "--tokens-file", junk)
    assert r.exit_code in (1, 2), r.output
    text = tmp_path / "t.txt"
    text.write_text("hello")
    r = _run("import", text, "--endpoint", kvd_daemon.endpoint, "--namespace", "x")
    assert r.exit_code == 1, r.output


# -- files written by mlx-lm 0.31 itself ---------------------------------------------
RESAVE_031 = """
import sys
from mlx_lm.models import cache as C
import mlx_lm
assert mlx_lm.__version__.startswith("0.31"), mlx_lm.__version__
cache, meta = C.load_prompt_cache(sys.argv[1], return_metadata=True)
C.save_prompt_cache(sys.argv[2], cache, meta)
print("RESAVED", mlx_lm.__version__)
"""


RECORDED_031 = TESTS / "fixtures" / "mlx_lm_031_files.msgpack.gz"


@memoize
def _recorded_031() -> dict:
    import gzip

    import msgpack

    rec = msgpack.unpackb(gzip.decompress(RECORDED_031.read_bytes()))
    assert rec["mlx_lm"] == "0.31.3"
    return rec["files"]


@pytest.mark.parametrize("case", list(CASES))
def test_import_file_written_by_mlx_lm_031_itself(kvd_daemon, tmp_path, case):
    """mlx-lm 0.31.3 loaded our 0.31-layout file and saved it again with its own
    save_prompt_cache (recorded by tests/fixtures/make_mlx_lm_031_files.py, so
    nothing is downloaded here): the two files must agree (so `save_031` is
    faithful), and the genuine one imports bit-exact."""
    model, cache, toks, opts = _cache(case)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_031(ours, cache, {"note": "031"})
    theirs.write_bytes(_recorded_031()[case])

    a_arrays, a_meta = mx.load(str(ours), return_metadata=True)
    b_arrays, b_meta = mx.load(str(theirs), return_metadata=True)
    assert a_meta == b_meta
    assert sorted(a_arrays) == sorted(b_arrays)
    for k in a_arrays:
        assert a_arrays[k].dtype == b_arrays[k].dtype and a_arrays[k].shape == b_arrays[k].shape, k
        x, y = a_arrays[k], b_arrays[k]
        if x.dtype == mx.bfloat16:
            x, y = x.view(mx.uint16), y.view(mx.uint16)
        assert bytes(memoryview(x)) == bytes(memoryview(y)), k

    namespace = namespace_for(model, **opts) if case != "concat" else "test-concat-real031"
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(toks))
    r = _run("import", theirs, "--endpoint", kvd_daemon.endpoint, "--namespace", namespace, "--tokens-file", tokens_file, "--json")
    assert r.exit_code == 0, r.output
    layers = [F.spec_of(c) for c in cache]
    assert_same_cache(toks, _fetch_all(kvd_daemon, namespace, toks, layers), cache)
