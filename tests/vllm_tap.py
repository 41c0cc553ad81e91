"""`python tests/vllm_tap.py LOG serve ...`: `kvd-vllm-mlx serve ...` that also writes the
logits of every language-model call (last position, float32 bytes as hex, one line
per call) to LOG, so a test can compare two servers' logits bit for bit.

Only for tests: the tap evaluates the logits inside the model call (a sync point
vllm-mlx would not have), on the calling thread.
"""

from __future__ import annotations

import sys


def tap(path: str) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.models.qwen2_vl.language import LanguageModel

    original = LanguageModel.__call__
    out = open(path, "a", buffering=1)

    def call(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        logits = getattr(result, "logits", result)
        row = np.array(logits[:, -1, :].astype(mx.float32))
        out.write(row.tobytes().hex() + "\n")
        return result

    LanguageModel.__call__ = call


if __name__ == "__main__":
    tap(sys.argv[1])
    from kvd_client.vllm_mlx.launcher import main

    main(sys.argv[2:])
