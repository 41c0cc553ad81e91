"""An offline mlx-lm model directory: tiny random llama + a word-level tokenizer.

`build_model_dir(path)` writes what `mlx_lm.load` (and so `mlx_lm.server`)
needs, with nothing downloaded:

    config.json              llama args (hidden, layers, vocab = tokenizer's)
    model.safetensors        tree_flatten(model.parameters()), seeded weights
    tokenizer.json           a `tokenizers` WordLevel model over WORDS + specials
    tokenizer_config.json    eos/bos/unk and a chat template

The same arguments give bit-identical files in every process (mlx RNG is
seeded), so two servers started on two copies share a kvd namespace.
Text for prompts is made of WORDS joined by spaces (`words(n, seed)`), so
one word is one token. `MlxServer` runs `python -m kvd_client.mlx_lm_server`
on such a directory on a free loopback port (tests and bench/bench_server.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = [
    f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ri", "so", "tu", "va", "ze", "bo", "di")
    for b in ("n", "r", "s", "t", "m", "k", "l", "p", "x", "")
]  # 120 words
VOCAB = SPECIALS + WORDS

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def words(n: int, seed: int = 0) -> str:
    """`n` space-separated vocabulary words (one token each), deterministic in `seed`."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_model_dir(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write a tiny random-weight llama model directory at `path`; returns it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(VOCAB),
        # Untied: with a tied random embedding the residual stream makes
        # argmax repeat the last token whatever the context; an untied head
        # gives context-dependent greedy output (so equality tests mean something).
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "bos_token_id": VOCAB.index("<s>"),
        "eos_token_id": VOCAB.index("</s>"),
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "model_max_length": 32768,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )


# -- running the server on it ---------------------------------------------------
class MlxServer:
    """`python -m kvd_client.mlx_lm_server --model DIR --port N ...` on loopback.

    `start()` waits for /health; `chat(system, user)` posts a chat completion
    at temperature 0 and returns the decoded JSON reply; `stop()` sends
    SIGTERM (the launcher shuts down cleanly and finishes queued uploads).
    """

    def __init__(self, model_dir: str | Path, log_path: str | Path, args: list[str] = ()):
        self.model_dir = str(model_dir)
        self.log_path = Path(log_path)
        self.args = list(args)
        self.port = 0
        self.proc = None

    def start(self, wait: bool = True) -> "MlxServer":
        import socket
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "kvd_client.mlx_lm_server", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def chat(self, system: str, user: str, max_tokens: int = 12, stream: bool = False, timeout: float = 120.0) -> dict:
        """A temperature-0 chat completion; the reply JSON (with `elapsed`, and `ttft` when streaming)."""
        import time
        import urllib.request

        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not stream:
                reply = json.load(r)
                reply["elapsed"] = time.perf_counter() - t0
                return reply
            ttft, text, usage = None, [], None
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(piece)
                usage = event.get("usage") or usage
            return {"ttft": ttft, "text": "".join(text), "usage": usage, "elapsed": time.perf_counter() - t0}

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        import subprocess

        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


if __name__ == "__main__":  # python tests/model_dir.py OUT_DIR
    import sys

    print(build_model_dir(sys.argv[1]))
