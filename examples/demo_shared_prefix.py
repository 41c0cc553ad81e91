"""Two processes, one model, one long shared system prompt: the second reuses the first's KV.

    python examples/demo_shared_prefix.py [--system-tokens 1024] [--endpoint ipc://...]

No download: both processes build the same random-weight llama (seeded, so
the weights are bit-identical) and derive the same namespace from it with
`namespace_for`. Unless --endpoint is given, a throwaway `kvd serve` is
started on a temporary socket and stopped at the end.

  writer process   prefills the system prompt, `store`s the cache, exits;
  reader process   builds prompt = system prompt + a user question, and
                   answers it twice with mlx-lm's `generate_step`:
                   cold (its own full prefill) and warm (`fetch`, then
                   prefill only the rest). It prints the tokens reused, the
                   time to first token of both, and checks that both produce
                   the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path


def build_model():
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(1234)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=768,
            num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=2048,
        )
    )
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(2048) for _ in range(n)]


def client(endpoint: str, model):
    from kvd_client import Client
    from kvd_client.mlx_lm import namespace_for

    return Client(endpoint, namespace=namespace_for(model))


def answer(model, prompt: list[int], cache, max_tokens: int) -> tuple[list[int], bytes, float]:
    """Greedy tokens from mlx-lm's generate_step, their log-probs' bytes, and the time to the first."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    out, logprobs, ttft = [], [], None
    for tok, lp in generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=max_tokens):
        if ttft is None:
            ttft = time.perf_counter() - t0
        out.append(int(tok))
        logprobs.append(np.array(lp.astype(mx.float32)).tobytes())  # exact for bf16
    return out, b"".join(logprobs), ttft


def writer(endpoint: str, system_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = build_model()
    system = tokens(system_tokens, seed=1)
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for s in range(0, len(system), 512):
        model(mx.array(system[s : s + 512])[None], cache=cache)
        mx.eval([c.state for c in cache])
    prefill = time.perf_counter() - t0
    with client(endpoint, model) as kv:
        t0 = time.perf_counter()
        kv.store(system, cache)  # the snapshot is taken here; the upload runs in the background
        on_caller = time.perf_counter() - t0
        kv.flush_stores(60)
        return {"prefill_s": prefill, "store_on_caller_s": on_caller, "stored": kv.counters.get("stored", 0)}


def reader(endpoint: str, system_tokens: int, max_tokens: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    model = build_model()
    prompt = tokens(system_tokens, seed=1) + tokens(48, seed=2)  # system prompt + a user question
    answer(model, tokens(64, seed=3), make_prompt_cache(model), 2)  # warm up mlx, untimed
    cold_out, cold_lp, cold_ttft = answer(model, prompt, make_prompt_cache(model), max_tokens)
    with client(endpoint, model) as kv:
        t0 = time.perf_counter()
        cache, n = kv.fetch(prompt)
        fetch_s = time.perf_counter() - t0
        if cache is None:
            cache = make_prompt_cache(model)
        warm_out, warm_lp, warm_rest = answer(model, prompt[n:], cache, max_tokens)
    return {
        "prompt": len(prompt), "reused": n, "fetch_s": fetch_s,
        "cold_ttft_s": cold_ttft, "warm_ttft_s": fetch_s + warm_rest,
        "same_tokens": cold_out == warm_out, "same_logprobs": cold_lp == warm_lp, "tokens": warm_out[:8],
    }


def run_role(role: str, args) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--endpoint", args.endpoint,
           "--system-tokens", str(args.system_tokens), "--max-tokens", str(args.max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"{role} process failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", help="use a running daemon instead of starting one")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--role", choices=["writer", "reader"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "writer":
        print(json.dumps(writer(args.endpoint, args.system_tokens)))
        return
    if args.role == "reader":
        print(json.dumps(reader(args.endpoint, args.system_tokens, args.max_tokens)))
        return

    with contextlib.ExitStack() as stack:
        if not args.endpoint:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
            from _util import daemon  # the benches' daemon launcher

            args.endpoint = stack.enter_context(daemon("--ram-mb", "512")).endpoint
        w = run_role("writer", args)
        print(f"writer: prefilled a {args.system_tokens}-token system prompt in {w['prefill_s'] * 1e3:.0f} ms; "
              f"store() held the generation thread {w['store_on_caller_s'] * 1e3:.1f} ms")
        r = run_role("reader", args)
        saved = r["cold_ttft_s"] - r["warm_ttft_s"]
        print(f"reader: reused {r['reused']} of {r['prompt']} prompt tokens (fetch {r['fetch_s'] * 1e3:.1f} ms)")
        print(f"        time to first token: cold {r['cold_ttft_s'] * 1e3:.0f} ms, "
              f"with kvd {r['warm_ttft_s'] * 1e3:.0f} ms -> saved {saved * 1e3:.0f} ms "
              f"({r['cold_ttft_s'] / r['warm_ttft_s']:.1f}x)")
        print(f"        same {args.max_tokens} greedy tokens as the cold run: {'yes' if r['same_tokens'] else 'NO'}; "
              f"bit-identical log-probs: {'yes' if r['same_logprobs'] else 'NO'}")
        if not (r["same_tokens"] and r["same_logprobs"]) or r["reused"] == 0:
            sys.exit(1)


if __name__ == "__main__":
    main()
