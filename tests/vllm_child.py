"""One vllm-mlx process, driven in-process (no HTTP), for the vllm-mlx tests and bench.

    python tests/vllm_child.py SPEC.json OUT.json

SPEC (JSON): `model` (a model dir from tests/model_dir.py), `endpoint` (a kvd
endpoint, or null for vllm-mlx without kvd), `prompts` (token-id lists, run
one after another), `max_tokens`, and optional `config` (SchedulerConfig
fields, e.g. kv_cache_quantization, ssd_cache_dir), `timeout`.

OUT (JSON) per request: `tokens` (greedy output), `logits` (hex of the
float32 bytes of every step's logits, as the sampler saw them), `cached`
(prompt tokens the scheduler reused), `hit` (its cache_hit_type), `ttft`
(seconds from add_request to the first token); plus `kvd` (the cache's kvd
counters, or null), `installed`, and `entries` (key length and layer
classes of every entry in vllm-mlx's RAM prefix cache). Uploads are finished (`close_all`,
as the launcher does at exit) before it exits.

With `drop` true, the scheduler and the model are dropped after the prompts
and collected (`gc.collect()`) before `close_all`; OUT then has `results`,
`installed`, `alive` (whether the model, the scheduler and its prefix cache
outlived that, by weak reference) and `caches` (how many `caches()` still lists).
"""

from __future__ import annotations

import gc
import json
import sys
import time
import weakref


def _install(spec: dict) -> bool:
    if not spec.get("endpoint"):
        return False
    import kvd_client.vllm_mlx as kv_vllm

    return kv_vllm.install(spec["endpoint"], timeout=spec.get("timeout", 2.0))


def _build(spec: dict):
    from mlx_lm import load
    from vllm_mlx.scheduler import Scheduler, SchedulerConfig

    model, tokenizer = load(spec["model"])
    if spec.get("warmup"):  # one throwaway forward pass: mlx's first-call costs stay out of TTFT
        import mlx.core as mx

        mx.eval(model(mx.array([[7, 8, 9]])))
    config = {"cache_memory_mb": 64, **spec.get("config", {})}
    return model, Scheduler(model, tokenizer, SchedulerConfig(**config))


def _serve(spec: dict, sched) -> list[dict]:
    import mlx.core as mx
    import numpy as np
    from vllm_mlx.request import Request, SamplingParams

    results = []
    for i, prompt in enumerate(spec["prompts"]):
        seen: list = []

        def tap(tokens, logits, seen=seen):
            seen.append(logits)
            return logits

        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logits_processors=[tap])
        req = Request(request_id=f"r{i}", prompt=list(prompt), sampling_params=params)
        t0 = time.perf_counter()
        sched.add_request(req)
        ttft, out = None, []
        while sched.has_requests():
            step = sched.step()
            for o in step.outputs:
                if o.new_token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    out = list(o.output_token_ids)
        logits = [np.array(x.astype(mx.float32)).tobytes().hex() for x in seen[: spec["max_tokens"]]]
        results.append({"tokens": out, "logits": logits, "cached": req.cached_tokens,
                        "hit": req.cache_hit_type, "ttft": ttft})
    return results


def _served_and_dropped(spec: dict) -> tuple[list[dict], dict]:
    """Serve the prompts; weak references to what is dropped when this returns."""
    model, sched = _build(spec)
    results = _serve(spec, sched)
    refs = {"model": weakref.ref(model), "scheduler": weakref.ref(sched),
            "cache": weakref.ref(sched.memory_aware_cache)}
    return results, refs


def run_and_drop(spec: dict) -> dict:
    installed = _install(spec)
    results, refs = _served_and_dropped(spec)
    gc.collect()
    alive = {name: ref() is not None for name, ref in refs.items()}
    caches = None
    if installed:
        import kvd_client.vllm_mlx as kv_vllm

        caches = len(kv_vllm.caches())
        kv_vllm.close_all()  # as the launcher at exit: here, waits for the collected caches' uploads
    return {"results": results, "installed": installed, "alive": alive, "caches": caches}


def run(spec: dict) -> dict:
    if spec.get("drop"):
        return run_and_drop(spec)
    installed = _install(spec)
    model, sched = _build(spec)
    results = _serve(spec, sched)
    kvd = None
    cache = sched.memory_aware_cache
    if installed:
        import kvd_client.vllm_mlx as kv_vllm

        # What the launcher does at exit: finish the uploads, close the clients.
        clients = list((cache._kvd.clients or {}).values())
        kv_vllm.close_all()
        kvd = {"cache": dict(cache.kvd_counters), "clients": {c.namespace: dict(c.counters) for c in clients}}
    if getattr(sched, "_ssd_tier", None) is not None:
        sched.close_ssd_tier()  # drains vllm-mlx's spill queue (its own SSD tier)
    entries = [[len(key), [type(layer).__name__ for layer in e.cache]] for key, e in cache._entries.items()]
    return {"results": results, "kvd": kvd, "installed": installed, "entries": entries}


if __name__ == "__main__":
    spec = json.loads(open(sys.argv[1]).read())
    out = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    import os

    os._exit(0)  # skip mlx's teardown (it can abort after a clean run)
