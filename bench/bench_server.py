"""Time to first token through the real mlx-lm server: cold vs a kvd hit.

    python bench/bench_server.py [--lengths 512,1024,2048] [--reps 3] [--hidden 128] [--layers 4]

Builds an offline random-weight llama (tests/model_dir.py), starts a kvd
daemon and three servers on loopback:
  * C  stock mlx-lm server (`--no-kvd`): the baseline, every request cold;
  * A  kvd-backed: sees each system prompt first (a kvd miss; it also pays for
       snapshotting its caches into kvd);
  * B  kvd-backed, the same model: asks the same system prompt with another
       question after A's upload has landed -- a kvd hit, local miss; then
       asks once more -- mlx-lm's own local LRU hit, for reference.
A request is `max_tokens=1` at temperature 0, so its wall time is the time to
first token (prefill + one step + HTTP). Every rep uses a fresh system
prompt. Prints medians per prompt length and the ratios to the stock cold
request measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _util import daemon, machine  # noqa: E402
from model_dir import MlxServer, build_model_dir, words  # noqa: E402


def system_segment(tokenizer, system: str, user: str) -> list[int]:
    """The tokens mlx-lm's server caches as the 'system' segment of this chat."""
    full = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}], add_generation_prompt=True
    )
    sys_only = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": ""}], add_generation_prompt=False
    )
    n = next((i for i, (a, b) in enumerate(zip(sys_only, full)) if a != b), 0)
    return list(full[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048", help="system prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    from mlx_lm.utils import load

    from kvd_client import Client
    from kvd_client.mlx_lm import namespace_for

    work = Path(tempfile.mkdtemp(prefix="kvd-bench-server-"))
    model_path = build_model_dir(work / "model", hidden_size=args.hidden, num_layers=args.layers,
                                 intermediate_size=2 * args.hidden, num_heads=4, num_kv_heads=2,
                                 head_dim=args.hidden // 4, dtype=args.dtype)
    model, tokenizer = load(str(model_path))
    namespace = namespace_for(model)

    print(f"bench_server: {machine()}; llama hidden {args.hidden} x {args.layers} layers, {args.dtype}; "
          f"{args.reps} reps, median seconds to first token")
    with daemon("--ram-mb", "1024") as d:
        endpoint = d.endpoint
        ep = ["--kvd-endpoint", endpoint]
        a = MlxServer(model_path, work / "a.log", ep)
        b = MlxServer(model_path, work / "b.log", ep)
        c = MlxServer(model_path, work / "c.log", ["--no-kvd"])
        servers = [a, b, c]
        rows = []
        try:
            for s in servers:
                s.start(wait=False)
            for s in servers:
                s.wait_ready()
            for s in servers:  # warm up: model load, first-call compilation
                s.chat(words(64, seed=999), "warm", max_tokens=1)
            with Client(endpoint, namespace=namespace, timeout=5) as kv:
                for n in lengths:
                    t = {"stock cold": [], "kvd miss (A)": [], "kvd hit (B)": [], "local hit (B)": []}
                    cached = []
                    for rep in range(args.reps):
                        system = words(n, seed=1000 * n + rep)
                        q1, q2 = words(16, seed=1), words(16, seed=2)
                        t["stock cold"].append(c.chat(system, q2, max_tokens=1)["elapsed"])
                        t["kvd miss (A)"].append(a.chat(system, q1, max_tokens=1)["elapsed"])
                        seg = system_segment(tokenizer, system, q1)
                        deadline = time.monotonic() + 60
                        while kv.probe(seg).n < len(seg) and time.monotonic() < deadline:
                            time.sleep(0.02)
                        hit = b.chat(system, q2, max_tokens=1)
                        t["kvd hit (B)"].append(hit["elapsed"])
                        cached.append(hit["usage"]["prompt_tokens_details"]["cached_tokens"])
                        t["local hit (B)"].append(b.chat(system, q2, max_tokens=1)["elapsed"])
                    rows.append((n, {k: statistics.median(v) for k, v in t.items()}, min(cached)))
        finally:
            for s in servers:
                s.stop()

    cols = ["stock cold", "kvd miss (A)", "kvd hit (B)", "local hit (B)"]
    print(f"{'tokens':>7} " + "".join(f"{c:>15}" for c in cols) + f"{'cached':>8}{'cold/hit':>10}{'miss/cold':>11}")
    for n, med, cached in rows:
        print(f"{n:>7} " + "".join(f"{med[c]:>15.3f}" for c in cols)
              + f"{cached:>8}{med['stock cold'] / med['kvd hit (B)']:>9.1f}x{med['kvd miss (A)'] / med['stock cold']:>10.2f}x")
    print("cold/hit: stock cold TTFT over kvd-hit TTFT (higher is better); "
          "miss/cold: a kvd server's cold request over the stock one (the cost of storing).")


if __name__ == "__main__":
    main()
