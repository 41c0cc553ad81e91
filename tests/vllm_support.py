"""Shared pieces of the vllm-mlx tests: the skip rule, child processes, prompts.

The vllm-mlx tests need the pinned vllm-mlx set (installed by `./dev`,
which `.ci/run` runs); without it they skip, saying so. `run_child` runs
tests/vllm_child.py (one vllm-mlx process with in-process schedulers) in a
fresh interpreter and returns its JSON report. `VllmServer` is vllm-mlx's
HTTP server as a tests/model_dir.py `LoopbackServer`; `start_all` and
`stop_all` start and stop several at once.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from model_dir import LoopbackServer, stop_all  # noqa: F401  (stop_all: the tests' import from here)

HERE = Path(__file__).resolve().parent
PINNED = "0.6.0"


def vllm_mlx_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm-mlx")
    except Exception:
        return None


requires_vllm_mlx = pytest.mark.skipif(
    vllm_mlx_version() is None,
    reason=f"vllm-mlx is not installed (./dev installs the pinned vllm-mlx {PINNED} set)",
)


def tokens(n: int, seed: int, lo: int = 7, hi: int = 127) -> list[int]:
    """`n` token ids of tests/model_dir.py's vocabulary (specials excluded), deterministic."""
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]


def run_child(tmp: Path, name: str, spec: dict, timeout: float = 300.0) -> dict:
    """Run one vllm-mlx process on `spec` (see tests/vllm_child.py); its report."""
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_child.py"), str(spec_path), str(out_path)],
        capture_output=True, text=True, timeout=timeout,
    )
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out_path.exists():
        raise AssertionError(f"vllm-mlx child {name} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    report = json.loads(out_path.read_text())
    report["log"] = proc.stderr
    return report


def run_child_aside(tmp: Path, name: str, spec: dict, timeout: float = 300.0):
    """`run_child` in a thread of its own, for a process that needs nothing of
    the test's others (a cold reference): a future of its report."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix=f"child-{name}")
    future = pool.submit(run_child, tmp, name, spec, timeout)
    pool.shutdown(wait=False)
    return future


def start_all(servers) -> None:
    """Start every one of `servers` at once, then wait until each answers: their
    start-ups (~3 s of imports and model loading each) overlap."""
    for s in servers:
        s.start(wait=False)
    for s in servers:
        s.wait_ready()


class VllmServer(LoopbackServer):
    """`python -m kvd_client.vllm_mlx serve DIR ...` (vllm-mlx's HTTP server) on loopback.

    HOME is a private folder: vllm-mlx 0.6 saves its RAM prefix cache under
    ~/.cache/vllm-mlx on a clean shutdown and loads it at start, and a test
    of kvd must not be helped by that. `complete(text)` posts a greedy
    /v1/completions; `stop()` sends SIGTERM (SIGKILL with `kill=True`).
    """

    name = "vllm-mlx"
    ready_timeout = 120.0

    def __init__(self, model_dir, workdir: Path, args: list[str] = (), kvd_endpoint: str | None = None,
                 tap: bool = False):
        self.model_dir, self.workdir, self.args = str(model_dir), Path(workdir), list(args)
        super().__init__(self.workdir / "server.log")
        self.kvd_endpoint = kvd_endpoint
        # tap: log the language model's logits (tests/vllm_tap.py) to workdir/logits.hex
        self.tap_path = self.workdir / "logits.hex" if tap else None

    def command(self) -> list[str]:
        kvd = ["--kvd-endpoint", self.kvd_endpoint] if self.kvd_endpoint else ["--no-kvd"]
        entry = [str(HERE / "vllm_tap.py"), str(self.tap_path)] if self.tap_path else ["-m", "kvd_client.vllm_mlx"]
        return [sys.executable, *entry, "serve", self.model_dir, "--host", "127.0.0.1",
                "--port", str(self.port), "--continuous-batching", "--offline", *kvd, *self.args]

    def environment(self) -> dict[str, str]:
        import os

        home = self.workdir / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        env.update(HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        return env

    def complete(self, prompt: str, max_tokens: int = 6, timeout: float = 120.0) -> dict:
        import time

        body = {"model": self.model_dir, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        t0 = time.perf_counter()
        with self.post("/v1/completions", body, timeout) as r:
            reply = json.load(r)
        reply["elapsed"] = time.perf_counter() - t0
        return reply

    def chat(self, system: str, user: str, max_tokens: int = 6, timeout: float = 120.0) -> dict:
        """A greedy /v1/chat/completions with a system and a user message."""
        body = {"model": self.model_dir, "max_tokens": max_tokens, "temperature": 0.0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        with self.post("/v1/chat/completions", body, timeout) as r:
            return json.load(r)

    def chat_image(self, system: str, image_seed: int, text: str, max_tokens: int = 6, timeout: float = 120.0) -> dict:
        """A greedy chat completion whose user message is a random 80x80 image (PNG) and `text`."""
        import base64
        import io

        import numpy as np
        from PIL import Image

        pixels = np.random.default_rng(image_seed).integers(0, 255, (80, 80, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        user = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
        body = {"model": self.model_dir, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
                "top_logprobs": 3, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        with self.post("/v1/chat/completions", body, timeout) as r:
            return json.load(r)

    def cached(self) -> list[int]:
        """`cached=` of every prefix-cache HIT vllm-mlx logged, in order (0 for a MISS)."""
        import re

        out = []
        for line in self.log().splitlines():
            if "[cache_fetch]" in line:
                m = re.search(r" HIT .*cached=(\d+)", line)
                out.append(int(m.group(1)) if m else 0)
        return out

    def logits(self) -> list[str]:
        """The tapped logits so far, one hex line per language-model call."""
        return self.tap_path.read_text().split() if self.tap_path and self.tap_path.exists() else []


def wait_for_puts(endpoint: str, prefix: str, at_least: int, timeout: float = 60.0) -> None:
    """Until the daemon has taken `at_least` PUTs in namespaces starting with `prefix`
    (a write-through upload is asynchronous)."""
    import time

    from kvd_client import Client

    deadline = time.monotonic() + timeout
    with Client(endpoint, namespace="probe", timeout=2.0) as c:
        while time.monotonic() < deadline:
            stats = c.stats() or {}
            puts = sum(v.get("puts", 0) for ns, v in stats.get("namespaces", {}).items() if ns.startswith(prefix))
            if puts >= at_least:
                return
            time.sleep(0.05)
    raise AssertionError(f"the daemon saw fewer than {at_least} PUTs in {prefix}* after {timeout}s")
