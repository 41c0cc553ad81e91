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
one word is one token.

The other builders (tests/vlm_dir.py) and servers (tests/vllm_support.py)
share this module's pieces: `save_model` (weights + config.json),
`write_tokenizer` (a WordLevel tokenizer over specials + WORDS) and
`LoopbackServer` (a server child process on a free loopback port, ready at
/health, stopped by SIGTERM). `MlxServer` is the one that runs
`python -m kvd_client.mlx_lm_server` (tests and bench/bench_server.py).
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
    save_model(path, llama.Model(llama.ModelArgs.from_dict(config)), config, dtype)
    write_tokenizer(path, SPECIALS, CHAT_TEMPLATE)
    return path


def save_model(path: Path, model, config: dict, dtype: str) -> None:
    """Write `model`'s parameters (cast to `dtype`) as model.safetensors, and config.json."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))


def write_tokenizer(path: Path, specials: list[str], chat_template: str) -> None:
    """tokenizer.json (WordLevel over `specials` + WORDS, one word one token) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = specials + WORDS
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(specials)
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
                "chat_template": chat_template,
            },
            indent=2,
        )
    )


# -- running a server on it ---------------------------------------------------
# Ports handed to servers of this process. A port is picked by binding to port 0
# and closing: two picked in a row may be the same one, and servers started
# together (vllm_support.start_all) then raced for it: one bound, the other
# failed, and its readiness check was answered by the first (a CI run).
_PORTS_GIVEN: set[int] = set()


def _new_port() -> int:
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


class LoopbackServer:
    """A server child process on a free loopback port, its output in `log_path`.

    A subclass says how to run it (`command()`, and `environment()` if not
    this process's). `start()` picks the port, starts it and (unless
    `wait=False`) waits until GET /health answers, failing with the log's tail
    if it exits or takes longer than `ready_timeout`; `post(path, body)` sends
    JSON; `stop()` sends SIGTERM (SIGKILL with `kill=True`) and reaps it.
    """

    name = "server"  # in error messages
    ready_timeout = 60.0

    def __init__(self, log_path: str | Path):
        self.log_path = Path(log_path)
        self.port = 0
        self.proc = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        return None  # inherit ours

    def start(self, wait: bool = True):
        import subprocess

        self.port = _new_port()
        cmd, env = self.command(), self.environment()  # may make the folder the log goes in
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        import time
        import urllib.request

        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.log()[-4000:]}")

    def post(self, path: str, body: dict, timeout: float):
        """POST `body` as JSON to `path`; the open response (a context manager)."""
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, kill: bool = False, timeout: float = 30.0) -> None:
        stop_all([self], timeout, kill=kill)


def stop_all(servers, timeout: float = 30.0, *, kill: bool = False) -> None:
    """SIGTERM (SIGKILL with `kill`) every one of `servers` still running at
    once, then wait for each (SIGKILL past `timeout`): the waits overlap."""
    import signal
    import subprocess

    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    for s in servers:
        if s.proc is None:
            continue
        try:
            s.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()
        s.proc = None


class MlxServer(LoopbackServer):
    """`python -m kvd_client.mlx_lm_server --model DIR --port N ...` on loopback.

    `chat(system, user)` posts a chat completion at temperature 0 and returns
    the decoded JSON reply; `stop()`'s SIGTERM lets the launcher shut down
    cleanly and finish queued uploads.
    """

    def __init__(self, model_dir: str | Path, log_path: str | Path, args: list[str] = ()):
        super().__init__(log_path)
        self.model_dir = str(model_dir)
        self.args = list(args)

    def command(self) -> list[str]:
        import sys

        return [sys.executable, "-m", "kvd_client.mlx_lm_server", "--model", self.model_dir,
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def chat(self, system: str, user: str, max_tokens: int = 12, stream: bool = False, timeout: float = 120.0) -> dict:
        """A temperature-0 chat completion; the reply JSON (with `elapsed`, and `ttft` when streaming)."""
        import time

        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        with self.post("/v1/chat/completions", body, timeout) as r:
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


if __name__ == "__main__":  # python tests/model_dir.py OUT_DIR
    import sys

    print(build_model_dir(sys.argv[1]))
