"""`kvd import FILE` and `kvd export`: mlx-lm prompt-cache files in and out of kvd.

Both commands import the client's mlx adapter (`kvd_client.mlx_lm_files`)
inside the command, so loading the CLI -- and `kvd serve` -- never imports mlx.

Namespace: `--namespace NS` as is, or `--model PATH` (a local mlx-lm model
directory) to derive it with `namespace_for`, with KV quantization options
taken from the file's caches on import (`--kv-bits` etc. to override).
Import falls back on the file's own metadata: `kvd_namespace` (files written
by `kvd export`), then `model` (files written by `mlx_lm.cache_prompt`).

Tokens: the file's `kvd_tokens` metadata if present, else `--tokens-file`
(a JSON list or whitespace-separated ids), or `--prompt-file` (text,
tokenized the way `mlx_lm.cache_prompt` does; needs the model).
"""

from __future__ import annotations

import json
from typing import Any

import click

from kvd.cli import exits, main
from kvd.cli.common import fail, settings
from kvd.cli.model_args import (
    Model, adapter_call, model_options, model_tokens_namespace, namespace_of, read_tokens, regular_file,
)

def _report(as_json: bool, result: dict[str, Any], line: str) -> None:
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else line)


@main.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False), callback=regular_file)
@model_options
def import_(file, namespace, model_path, tokens_file, prompt_file,
            kv_bits, kv_group_size, quantized_kv_start, max_kv_size, as_json, **flags) -> None:
    """Load an mlx-lm prompt-cache FILE (save_prompt_cache, mlx-lm 0.31 or 0.32) into kvd.

    Exits 1 if the file cannot be read or does not match the model, 2 on bad
    flags (no namespace or no tokens to be found), 3 if no daemon answers.
    """
    from kvd_client import Client
    from kvd_client.mlx_lm_files import MODEL_KEY, NAMESPACE_KEY, TOKENS_KEY, CacheFileError, read

    cfg = settings(flags)
    try:
        cf = read(file)
    except CacheFileError as err:
        fail(exits.FAILED, str(err))
    model = Model(model_path, "--model") if model_path else Model(cf.metadata.get(MODEL_KEY), "the file's metadata")
    if tokens_file or prompt_file:
        tokens = read_tokens(tokens_file, prompt_file, model)
    else:
        try:
            tokens = cf.tokens
        except ValueError as err:
            fail(exits.FAILED, f"{file}: file metadata {TOKENS_KEY}: {err}")
    if tokens is None:
        raise click.UsageError("the file holds no token ids: give --tokens-file (or --prompt-file)")
    held = cf.n_tokens
    if held is not None and held != len(tokens):
        fail(exits.FAILED, f"the cache holds {held} tokens but {len(tokens)} token ids were given")
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size)
    if namespace is None:
        if model_path is None and NAMESPACE_KEY in cf.metadata:
            namespace = cf.metadata[NAMESPACE_KEY]  # written by `kvd export`
        elif model.path is not None:
            namespace = namespace_of(model, cf.cache, kv)
        else:
            raise click.UsageError("no namespace: give --namespace or --model (the file names no model)")
    with Client(cfg.endpoint, namespace=namespace, timeout=cfg.timeout, strict=True) as client:
        ok = adapter_call(lambda: client.store(tokens, cf.cache, wait=True))
        held_now = adapter_call(lambda: client.probe(tokens)).n
    if not ok or held_now < len(tokens):
        fail(exits.FAILED, f"the daemon holds {held_now} of {len(tokens)} tokens (too big for its tiers?)")
    result = {"file": str(file), "layout": cf.layout, "layers": len(cf.cache), "tokens": len(tokens), "namespace": namespace}
    _report(as_json, result, f"imported {len(tokens)} tokens ({cf.layout} file, {len(cf.cache)} layers) into {namespace}")


@main.command("export")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="File to write (safetensors).")
@model_options
def export(output, namespace, model_path, tokens_file, prompt_file,
           kv_bits, kv_group_size, quantized_kv_start, max_kv_size, as_json, **flags) -> None:
    """Write the cache kvd holds for some tokens as an mlx-lm prompt-cache file.

    The file is written by the installed mlx-lm's save_prompt_cache, so its
    load_prompt_cache reads it back bit-exact; the token ids go in its
    metadata (`kvd_tokens`). If kvd holds only a prefix of the tokens, that
    prefix is exported (and said). Exits 1 if kvd holds none of it, 3 if
    no daemon answers.
    """
    from kvd_client import Client
    from kvd_client.mlx_lm import SnapshotMismatch, rebuild
    from kvd_client.mlx_lm_files import CacheFileError, export_metadata, write

    cfg = settings(flags)
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size)
    model, tokens, namespace = model_tokens_namespace(namespace, model_path, tokens_file, prompt_file, kv)
    with Client(cfg.endpoint, namespace=namespace, timeout=cfg.timeout, strict=True) as client:
        hit = adapter_call(lambda: client.get(tokens))
        if hit is not None and (hit.meta or {}).get("bnd") and hit.boundary is None:
            # Recurrent/windowed layers: only a prefix ending at stored state is a cache.
            hit = adapter_call(lambda: client.get(tokens, need_boundary=True))
    if hit is None:
        fail(exits.FAILED, f"kvd holds none of these {len(tokens)} tokens in {namespace}")
    try:
        cache = rebuild(hit)
    except SnapshotMismatch as err:
        fail(exits.FAILED, f"kvd's entry cannot be rebuilt: {err}")
    try:
        write(output, cache, export_metadata(tokens[: hit.n], namespace, model_path))
    except CacheFileError as err:
        fail(exits.FAILED, f"cannot export: {err}")
    except OSError as err:
        fail(exits.FAILED, f"cannot write {output}: {err.strerror or err}")
    result = {"output": str(output), "tokens": hit.n, "requested": len(tokens), "layers": len(cache), "namespace": namespace}
    partial = "" if hit.n == len(tokens) else f" (kvd holds only {hit.n} of the {len(tokens)} tokens)"
    _report(as_json, result, f"exported {hit.n} tokens ({len(cache)} layers) from {namespace} to {output}{partial}")
