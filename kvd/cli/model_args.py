"""What the commands that name a model and a token sequence share (`kvd
import`, `kvd export`, `kvd explain`): their options, the model named by
`--model` (loaded once, lazily, through the client's mlx adapter, so loading
the CLI never imports mlx), the namespace derived from it, and the tokens.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import click

from kvd.cli import exits
from kvd.cli.common import daemon_options, fail

def regular_file(ctx, param, value):
    """click callback: the path must be a regular file. click.Path(exists=True,
    dir_okay=False) lets a FIFO or a device through, and reading one blocks for ever."""
    if value is not None and not stat.S_ISREG(os.stat(value).st_mode):
        raise click.BadParameter(f"{value} is not a regular file.")
    return value


def _local_dir(ctx, param, value):
    """click callback: --model must be an existing directory (mlx-lm would download any other name)."""
    if value is not None and not os.path.isdir(os.path.expanduser(value)):
        raise click.BadParameter(f"{value} is not a local model directory (kvd never downloads models).")
    return value


_namespace = click.option("--namespace", default=None, help="kvd namespace to use as is.")
_model = click.option("--model", "model_path", default=None, callback=_local_dir,
                      help="Local mlx-lm model directory; the namespace is derived from it.")
_tokens_file = click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), callback=regular_file, default=None,
                            help="Token ids (JSON list or whitespace separated).")
_prompt_file = click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), callback=regular_file, default=None,
                            help="Prompt text, tokenized like mlx_lm.cache_prompt (needs the model).")
_kv = [
    click.option("--kv-bits", type=int, default=None, help="KV quantization bits the model's server uses [import: from the file]."),
    click.option("--kv-group-size", type=int, default=None, help="KV quantization group size [import: from the file; else 64]."),
    click.option("--quantized-kv-start", type=int, default=None, help="mlx-lm's --quantized-kv-start [default: mlx-lm's default]."),
    click.option("--max-kv-size", type=int, default=None, help="mlx-lm's --max-kv-size, if the cache was made with one."),
]
_json = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def model_options(fn):
    for opt in reversed([daemon_options, _namespace, _model, _tokens_file, _prompt_file, *_kv, _json]):
        fn = opt(fn)
    return fn


def adapter_call(fn):
    """Run a client call; the adapter's refusals get this command's words (the
    daemon's errors and its absence map to exit codes in kvd.cli.exits)."""
    from kvd_client.mlx_lm import SnapshotMismatch, UnsupportedCache

    from kvd.protocol.errors import KvdError

    try:
        return fn()
    except (UnsupportedCache, SnapshotMismatch) as err:  # ours, not the daemon's
        fail(exits.FAILED, f"the cache does not fit this namespace: {err}")
    except (ValueError, TypeError, AttributeError) as err:
        # A backstop: a cache the file readers let through but the snapshot
        # cannot take (kvd's own errors keep their exit codes in kvd.cli.exits).
        if isinstance(err, KvdError):
            raise
        fail(exits.FAILED, f"the cache cannot be stored: {type(err).__name__}: {err}")


class Model:
    """The model named by --model (or the file's metadata), loaded once, lazily."""

    def __init__(self, path: str | None, origin: str = "--model"):
        self.path = path
        self.origin = origin  # where the name came from, for messages
        self._loaded: tuple[Any, Any] | None = None

    def load(self) -> tuple[Any, Any]:
        if self._loaded is None:
            from kvd_client.mlx_lm_files import load_model

            try:
                self._loaded = load_model(self.path)
            except NotADirectoryError as err:
                fail(exits.FAILED, f"model {self.path} (named by {self.origin}): {err.strerror}: give --namespace, or --model DIR")
            except Exception as err:
                fail(exits.FAILED, f"cannot load model {self.path}: {err}")
        return self._loaded


def namespace_of(model: Model, cache: list[Any] | None, kv: dict[str, Any]) -> str:
    from kvd_client.mlx_lm_files import namespace_of as derive

    m, _ = model.load()
    return derive(
        m, cache, kv_bits=kv["kv_bits"], kv_group_size=kv["kv_group_size"],
        quantized_kv_start=kv["quantized_kv_start"], max_kv_size=kv["max_kv_size"],
    )


def read_tokens(tokens_file: str | None, prompt_file: str | None, model: Model) -> list[int] | None:
    from kvd_client.mlx_lm_files import parse_tokens

    if tokens_file:
        try:
            return parse_tokens(Path(tokens_file).read_text())
        except ValueError as err:
            raise click.UsageError(f"--tokens-file {tokens_file}: {err}")
    if prompt_file:
        if model.path is None:
            raise click.UsageError("--prompt-file needs --model (to tokenize)")
        from kvd_client.mlx_lm_files import tokenize_prompt

        _, tokenizer = model.load()
        return tokenize_prompt(tokenizer, Path(prompt_file).read_text())
    return None


def model_tokens_namespace(namespace: str | None, model_path: str | None, tokens_file: str | None,
                           prompt_file: str | None, kv: dict[str, Any]) -> tuple[Model, list[int], str]:
    """What `kvd export` and `kvd explain` act on: the model (loaded lazily),
    the tokens, and the namespace (given, or derived from the model with `kv`).
    Raises click.UsageError when either cannot be found."""
    model = Model(model_path)
    if namespace is None and model_path is None:
        raise click.UsageError("give --namespace or --model")
    tokens = read_tokens(tokens_file, prompt_file, model)
    if not tokens:
        raise click.UsageError("give --tokens-file (or --prompt-file with --model)")
    if namespace is None:
        namespace = namespace_of(model, None, kv)
    return model, tokens, namespace
