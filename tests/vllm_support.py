"""Shared pieces of the vllm-mlx tests: the skip rule, child processes, prompts.

The vllm-mlx tests need the pinned vllm-mlx set (`.ci/install-vllm-mlx`,
which `.ci/run` runs); without it they skip, saying so. `run_child` runs
tests/vllm_child.py (one vllm-mlx process with in-process schedulers) in a
fresh interpreter and returns its JSON report.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

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
    reason=f"vllm-mlx is not installed (run .ci/install-vllm-mlx for the pinned vllm-mlx {PINNED} set)",
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
