"""`kvd explain`: how much of a token sequence the daemon holds, and why no more.

Namespace and tokens are given as for `kvd export` (`--namespace` or
`--model`; `--tokens-file` or `--prompt-file`). With `--model` the namespace
is derived by `namespace_for`, which also tells the daemon what the id is
made of (so it can name the field in which another namespace differs) and
whether the model needs boundary state.
"""

from __future__ import annotations

import json

import click

from kvd.cli import main
from kvd.cli.common import settings, shown
from kvd.cli.model_args import adapter_call, model_options, model_tokens_namespace


def render(namespace: str, e) -> str:
    """The text form of an Explanation."""
    lines = [
        f"namespace  {namespace}",
        f"held       {e.n} of {e.tokens} tokens" + (f" (boundary state at {list(e.boundaries)})" if e.boundaries else ""),
        f"reason     {e.reason}",
        f"           {e.message}",
    ]
    for key, value in sorted(e.detail.items()):
        if key == "fields":
            for name, (mine, theirs) in value.items():
                lines.append(f"  differs  {name}: {mine!r} here, {theirs!r} there")
        else:
            lines.append(f"  {key:<8} {value}")
    return "\n".join(lines)


@main.command("explain")
@model_options
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Chunk size the model server uses.")
@click.option("--need-boundary/--no-need-boundary", default=None,
              help="The model has recurrent or sliding-window layers [default: from --model's layout, else no].")
def explain_cmd(namespace, model_path, tokens_file, prompt_file, kv_bits, kv_group_size,
                quantized_kv_start, max_kv_size, as_json, chunk_tokens, need_boundary, **flags) -> None:
    """Say how far the daemon holds a token sequence and why it stops there:
    held, never_stored, other_namespace (with the differing field),
    evicted (when, from which tier, why), quarantined, boundary_missing,
    or tokens_differ (at which position).

    Exits 2 on bad flags, 3 if no daemon answers, 4 if it refuses.
    """
    from kvd_client import Client

    cfg = settings(flags)
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size)
    _, tokens, namespace = model_tokens_namespace(namespace, model_path, tokens_file, prompt_file, kv)
    with Client(cfg.endpoint, namespace=namespace, timeout=cfg.timeout, chunk_tokens=chunk_tokens, strict=True) as client:
        e = adapter_call(lambda: client.explain(tokens, need_boundary=need_boundary))
    if as_json:
        click.echo(json.dumps({"namespace": namespace, "n": e.n, "tokens": e.tokens, "reason": e.reason,
                               "message": e.message, "boundaries": list(e.boundaries), "detail": e.detail},
                              indent=2, sort_keys=True, default=repr))
    else:
        click.echo(shown("EXPLAIN", render, namespace, e))
