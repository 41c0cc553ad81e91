"""End to end over HTTP: stock mlx-lm servers with kvd as their prompt cache.

One offline model directory, one real `kvd serve`, servers started with
`python -m kvd_client.mlx_lm_server` on free loopback ports:

* server A sees a long system prompt; server B (same model, same daemon)
  then answers the same system prompt with another question from kvd, and
  at temperature 0 says exactly what server C (`--no-kvd`) says cold;
* A, stopped right after a new prompt and restarted, answers its first
  request from kvd;
* with the daemon stopped, A and B still answer (local cache only) and say
  so once in their log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvd_client import Client
from model_dir import MlxServer, build_model_dir, words

SYSTEM = words(700, seed=11)  # ~700 tokens: two full 256-token chunks and a tail


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("model"))


def _namespace_stats(endpoint: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvd", "stats", "--json", "--endpoint", endpoint],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["namespaces"]


def _wait_stored(endpoint: str, min_entries: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spaces = {ns: s for ns, s in _namespace_stats(endpoint).items() if ns.startswith("mlx.")}
        if sum(s.get("entries", 0) for s in spaces.values()) >= min_entries:
            return spaces
        time.sleep(0.1)
    raise AssertionError("the first server's caches never reached kvd")


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def test_two_servers_share_restart_hits_and_daemon_loss_is_harmless(kvd_daemon, model_path, tmp_path):
    ep = ["--kvd-endpoint", kvd_daemon.endpoint]
    a = MlxServer(model_path, tmp_path / "a.log", ep)
    b = MlxServer(model_path, tmp_path / "b.log", ep)
    c = MlxServer(model_path, tmp_path / "c.log", ["--no-kvd"])
    servers = [a, b, c]
    try:
        for s in servers:
            s.start(wait=False)
        for s in servers:
            s.wait_ready()

        # 1. A computes the system prompt cold and stores it in kvd.
        first = a.chat(SYSTEM, words(12, seed=1))
        assert _cached(first) == 0
        spaces = _wait_stored(kvd_daemon.endpoint, min_entries=3)
        assert len(spaces) == 1, spaces  # one namespace: the model
        (namespace,) = spaces

        # 2. B, which never saw it, gets the system prompt from kvd ...
        question = words(12, seed=2)
        shared = b.chat(SYSTEM, question)
        n_shared = _cached(shared)
        assert n_shared >= 700, shared["usage"]
        assert n_shared < shared["usage"]["prompt_tokens"]
        stats = _namespace_stats(kvd_daemon.endpoint)[namespace]
        assert stats["hits"] >= 1 and stats["tokens_served"] >= n_shared, stats

        # ... and says exactly what a server without kvd says cold.
        cold = c.chat(SYSTEM, question)
        assert _cached(cold) == 0
        assert _text(shared) == _text(cold)
        assert shared["usage"]["completion_tokens"] == cold["usage"]["completion_tokens"]

        # 3. A restarted: its first request is a kvd hit -- also for a prompt
        # it saw just before SIGTERM (a clean stop finishes queued uploads).
        other = words(600, seed=12)
        assert _cached(a.chat(other, words(12, seed=3))) <= 1  # (mlx-lm shares the "<|system|>" token)
        a.stop()
        a.start()
        again = a.chat(other, words(12, seed=4))
        assert _cached(again) >= 600, again["usage"]
        assert _text(again) == _text(c.chat(other, words(12, seed=4)))
        assert _cached(a.chat(SYSTEM, words(12, seed=3))) >= 700

        # 4. The daemon goes away mid-run: requests still succeed.
        kvd_daemon.stop()
        for server, seed in ((a, 4), (b, 5), (a, 6), (b, 7)):
            reply = server.chat(SYSTEM, words(12, seed=seed))
            assert reply["usage"]["completion_tokens"] > 0
        for server in (a, b):
            lines = [line for line in server.log().splitlines() if "kvd: daemon at" in line and "stopped answering" in line]
            assert len(lines) == 1, server.log()
    finally:
        for s in servers:
            s.stop()


def test_server_without_daemon_serves_and_says_so_once(daemon_factory, model_path, tmp_path):
    absent = daemon_factory(start=False)  # a socket path nobody binds
    s = MlxServer(model_path, tmp_path / "s.log", ["--kvd-endpoint", absent.endpoint])
    try:
        s.start()
        r1 = s.chat(SYSTEM, words(8, seed=1))
        r2 = s.chat(SYSTEM, words(8, seed=2))
        assert r1["usage"]["completion_tokens"] > 0
        assert _cached(r2) > 0  # the local LRU still works
        said = [line for line in s.log().splitlines() if "no daemon answering" in line]
        assert len(said) == 1, s.log()

        # The daemon arrives: the server starts using it (after its back-off).
        absent.start()
        deadline = time.monotonic() + 40
        ns_entries = 0
        seed = 10
        while time.monotonic() < deadline and not ns_entries:
            s.chat(SYSTEM, words(8, seed=seed))
            seed += 1
            with Client(absent.endpoint, namespace="x", timeout=2) as c:
                spaces = (c.stats() or {}).get("namespaces", {})
            ns_entries = sum(v.get("entries", 0) for k, v in spaces.items() if k.startswith("mlx."))
            time.sleep(0.5)
        assert ns_entries > 0, s.log()
    finally:
        s.stop()


def test_quantized_kv_servers_share_through_kvd(kvd_daemon, model_path, tmp_path):
    """--kv-bits servers (served one request at a time, quantized caches) share too."""
    flags = ["--kvd-endpoint", kvd_daemon.endpoint, "--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    a = MlxServer(model_path, tmp_path / "qa.log", flags)
    b = MlxServer(model_path, tmp_path / "qb.log", flags)
    try:
        a.start(wait=False), b.start(wait=False)
        a.wait_ready(), b.wait_ready()
        assert _cached(a.chat(SYSTEM, words(12, seed=1))) == 0
        _wait_stored(kvd_daemon.endpoint, min_entries=3)
        reply = b.chat(SYSTEM, words(12, seed=2))
        # No system segment on this path: the full chunks of A's prompt are shared.
        assert _cached(reply) >= 512, reply["usage"]
        assert reply["usage"]["completion_tokens"] > 0
    finally:
        a.stop(), b.stop()
