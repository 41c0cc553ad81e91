"""Time to first token of vllm-mlx: cold vs its own SSD tier vs kvd, across processes.

    python bench/bench_vllm.py [--lengths 512,1024,2048,4096] [--hidden 256] [--layers 4]

Needs the pinned vllm-mlx set (./dev installs it). Builds an offline
random-weight llama (tests/model_dir.py) and, for each shared-prefix length
P, runs fresh vllm-mlx processes (in-process `Scheduler`, tests/vllm_child.py;
each does one warm-up forward pass first). A first process answers
"system prompt of P tokens + question A" (greedy, one token). Each measured
request then runs in a fresh process whose RAM prefix cache is empty:

  new ask    the system prompt with another question B;
  next turn  the first conversation going on: system + A + its answer + B.

  * cold   vllm-mlx alone: the whole prompt is prefilled;
  * ssd    vllm-mlx's own SSD tier (`ssd_cache_dir`): the first process then
           runs an unrelated prompt, so its RAM cache (sized for one entry)
           evicts the first entry to the SSD tier; the measured process shares
           that directory (its lookup finds a stored entry that is a prefix of
           the request, and promotes it into RAM);
  * kvd    kvd-backed vllm-mlx: the first process wrote its entry through to
           kvd; the measured process reuses the longest stored prefix (at kvd's
           256-token chunk granularity, or the whole stored sequence).

TTFT is timed inside the process, from `add_request` to the first token (the
cache lookup, any read and rebuild, the remaining prefill and one step). One
run per cell; ratios are against the cold request of the same length.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _util import daemon, machine  # noqa: E402
from model_dir import build_model_dir  # noqa: E402
from vllm_support import run_child, tokens  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir="/tmp"))
    heads = args.hidden // 64
    model = str(build_model_dir(work / "llama", hidden_size=args.hidden, num_layers=args.layers,
                                intermediate_size=2 * args.hidden, num_heads=heads, num_kv_heads=max(1, heads // 2),
                                head_dim=64))
    kv_per_token = args.layers * 2 * max(1, heads // 2) * 64 * 4  # float32 K and V
    print(f"bench_vllm: {machine()}; llama hidden {args.hidden} x "
          f"{args.layers} layers, float32; vllm-mlx in-process Scheduler; one run per cell, seconds to first token")
    print(f"{'prefix':>7} {'request':>9} {'cold':>8} {'ssd':>8} {'kvd':>8} {'ssd cached':>11} {'kvd cached':>11} "
          f"{'cold/ssd':>9} {'cold/kvd':>9}")
    with daemon() as d:
        endpoint = d.endpoint
        for p in lengths:
            rng = random.Random(p)
            system = tokens(p, seed=rng.randrange(1 << 30))
            ask_a, ask_b = (tokens(32, seed=rng.randrange(1 << 30)) for _ in range(2))
            unrelated = tokens(p + 40, seed=rng.randrange(1 << 30))
            # RAM for one entry of this size (vllm-mlx rejects entries bigger than its budget).
            mem_mb = max(1, int(1.5 * (p + 80) * kv_per_token / 2**20) + 1)
            base = {"model": model, "max_tokens": 1, "warmup": True}

            def one(name, endpoint, prompts, p=p, base=base, mem_mb=mem_mb, **config):
                spec = {**base, "endpoint": endpoint, "prompts": prompts, "config": {"cache_memory_mb": mem_mb, **config}}
                return run_child(work, f"{name}-{p}", spec, timeout=900)["results"]

            ssd_dir = str(work / f"ssd-{p}")
            first = one("ssd-warm", None, [system + ask_a, unrelated], ssd_cache_dir=ssd_dir)[0]
            one("kvd-warm", endpoint, [system + ask_a])
            requests = {
                "new ask": system + ask_b,  # same system prompt, another question
                "next turn": system + ask_a + first["tokens"] + ask_b,  # the first conversation goes on
            }
            for label, prompt in requests.items():
                cold = one(f"cold-{label}", None, [prompt])[0]
                ssd = one(f"ssd-{label}", None, [prompt], ssd_cache_dir=ssd_dir)[0]
                kvd = one(f"kvd-{label}", endpoint, [prompt])[0]
                print(f"{p:>7} {label:>9} {cold['ttft']:>8.3f} {ssd['ttft']:>8.3f} {kvd['ttft']:>8.3f} {ssd['cached']:>11} "
                      f"{kvd['cached']:>11} {cold['ttft'] / ssd['ttft']:>8.1f}x {cold['ttft'] / kvd['ttft']:>8.1f}x")
    print("cold/x: cold TTFT over x's TTFT (higher is better); cached: prompt tokens the measured request reused.")


if __name__ == "__main__":
    main()
