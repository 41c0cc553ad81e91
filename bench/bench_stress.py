"""A well-behaved client's latency while other peers attack the daemon.

    python bench/bench_stress.py [--samples 2000] [--daemon-python PATH]

One daemon (SSD tier on, 64 MiB RAM, 16 MiB messages). The well-behaved
client stores a 300-token prefix, then times GET round trips of it (a RAM
hit, ~50 KiB of tensors) -- first idle, then under each attack of issue 12,
each in its own process and ongoing while the client measures:

  ping-flood      16 peers pump PINGs as fast as they can, never reading
  idle-conns      1,000 raw connections held open
  stalled-frames  6 peers stalled inside 150 MiB messages (10 x 15 MiB frames)
  mute-big-gets   a peer pumps GETs of 4 MiB SSD entries, never reading
  huge-headers    a peer sends 4 M-map headers (MALFORMED) back to back
  long-lookups    a peer sends LOOKUPs of 1 M tokens with chunk_tokens=1
  heavy-peers     8 peers send those LOOKUPs, each as fast as answered
  put-storm       4 clients PUT new prompts of small chunks (16 KiB) as fast
                  as answered: more than the disk can write behind
  churn           4 peers each connect, PING, read the reply and hang up, as
                  fast as they can: every request on a new connection
  tiny-flood      a peer PUTs new sequences of 8,000 tiny chunks each
                  (chunk_tokens=1, 4 bytes a chunk), back to back (issue 44)
  frame-bomb      a peer sends one message of 8 M empty frames (ZMTP written
                  by hand), again and again on a new connection, reading each
                  answer (issue 44)
  lane-bomb       the same, each on a lane of its own, asked for in HELLO
                  (issue 44; on the main socket where no lane is offered)
  bomb-swarm      frame-bomb from one process on 32 threads at once, each on
                  connections of its own (session 31)
  cpu-hogs        no peer at all: one process per core spins on the CPU and
                  never touches the daemon. What the machine alone does to the
                  good client (and to its daemon); an attack that keeps the
                  cores as busy cannot be within 2x where this row is not
  paused-remote   the daemon has a remote tier (a real redis-server); a peer
                  pauses the server (SIGSTOP) for 0.3 s, within
                  remote_timeout_s, and GETs a new prompt meanwhile (the
                  daemon must ask the server), again and again (issue 44)

Each attack gets a fresh daemon (damage must not carry over from one row to
the next): the client measures idle, then the attack runs `--warmup` seconds
(3) and the client measures again. Prints p50/p99 idle and under attack,
their ratio, and the daemon's peak RSS; at the end, which attacks kept the
good client's p99 within 2x of its idle p99 (issue 44's bar), and what
cpu-hogs (not an attack) did to it.
`--daemon-python` runs the daemon with another interpreter (e.g. an older
checkout's venv) to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import msgpack
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _util import MiB, daemon, machine  # noqa: E402
from stress import CHURN, FLOOD, HAMMER, PARTIAL, PUMP, STORM, ZMTP, attack, status  # noqa: E402

from kvd.protocol import codec, keys  # noqa: E402
from kvd_client import Client, HostTensor, Snapshot  # noqa: E402


# A peer that PUTs new sequences of N tiny chunks (chunk_tokens=1, a 4-byte
# tensor each) as fast as they are answered, until stdin closes.
TINY = r"""
import select, sys, zmq
from kvd.protocol import codec, keys
ep, n = sys.argv[1], int(sys.argv[2])
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(ep)
data = [bytes([i % 256]) * 4 for i in range(n)]
print("ready", flush=True)
seq = 0
while not select.select([sys.stdin], [], [], 0)[0]:
    seq += 1
    chunks = [{"index": i, "tensors": [codec.Tensor("k", "uint8", (1, 1, 4), data[i])], "meta": b""} for i in range(n)]
    toks = keys.token_bytes(range(seq * n, seq * n + n))
    s.send_multipart(codec.encode("PUT", {"ns": "tiny", "tokens": toks, "chunk_tokens": 1, "chunks": chunks}, id=seq), copy=False)
    s.recv_multipart()
"""

# One bomb on a connection of its own to `path`, then its answer (or the
# daemon hanging up), or stdin closing.
_ONCE = ZMTP + r"""
import select, sys

def bomb_once(path, message):
    s = None
    try:
        s, _ = zmtp_connect(path)
        s.sendall(message)
        r, _, _ = select.select([sys.stdin, s], [], [])
        if s in r:
            s.recv(1 << 16)
    except OSError:
        pass  # dropped by the daemon (its memory watchdog sheds such a peer)
    finally:
        if s is not None:
            s.close()
"""

# A peer that sends one message of N empty frames (a PING header first),
# reads the answer (an error), and sends it again, until stdin closes.
BOMB = _ONCE + r"""
path, n = sys.argv[1], int(sys.argv[2])
from kvd.protocol import codec
message = zmtp_bomb(codec.encode("PING", {}, id=9)[0], n - 1)
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:  # again (on a new connection if dropped) until stdin closes
    bomb_once(path, message)
"""

# The same bomb on a lane of its own (kvd/server/lanes.py): each time a
# HELLO on the main socket asks for a lane, and the bomb goes there (a
# daemon that offers none gets it on the main socket, like frame-bomb).
LANE_BOMB = _ONCE + r"""
import zmq
endpoint, n = sys.argv[1], int(sys.argv[2])
from kvd.protocol import codec
message = zmtp_bomb(codec.encode("PING", {}, id=9)[0], n - 1)
ctx = zmq.Context()
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    main = ctx.socket(zmq.DEALER)
    main.setsockopt(zmq.LINGER, 0)
    main.connect(endpoint)
    path = endpoint[len("ipc://"):]
    main.send_multipart(codec.encode("HELLO", {"versions": [1], "lanes": True}, id=1))
    if main.poll(2000):
        path = codec.decode_reply(main.recv_multipart()).get("lane", endpoint)[len("ipc://"):]
    main.close(linger=0)
    bomb_once(path, message)
"""

# BOMB from one process on T threads at once, each on connections of its
# own, again and again (its bombs are shed for memory before they are whole).
SWARM = _ONCE + r"""
import threading
path, n, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from kvd.protocol import codec
message = zmtp_bomb(codec.encode("PING", {}, id=9)[0], n - 1)

def loop():
    while True:
        bomb_once(path, message)

for _ in range(t):
    threading.Thread(target=loop, daemon=True).start()
print("ready", flush=True)
select.select([sys.stdin], [], [])
"""

# One process per core that spins until stdin closes: no request at all.
HOGS = r"""
import multiprocessing as mp, os, select, sys

def spin():
    while True:
        pass

procs = [mp.get_context("fork").Process(target=spin, daemon=True) for _ in range(int(sys.argv[1]))]
for p in procs:
    p.start()
print("ready", flush=True)
select.select([sys.stdin], [], [])
for p in procs:
    p.kill()
"""

# A peer that pauses the remote server (SIGSTOP) for P seconds and, while it
# is paused, GETs a prompt nobody stored (the daemon must ask the server),
# again and again until stdin closes. The server is always resumed.
PAUSER = r"""
import os, select, signal, sys, threading
from kvd_client import Client
ep, pid, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
c = Client(ep, namespace="paused", timeout=10.0)
c.ping()
print("ready", flush=True)
seq = 0
try:
    while not select.select([sys.stdin], [], [], 0)[0]:
        seq += 1
        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(pause, os.kill, (pid, signal.SIGCONT))
        timer.start()
        c.get(list(range(seq * 1000, seq * 1000 + 600)))
        timer.join()
finally:
    os.kill(pid, signal.SIGCONT)
"""


CELL_SECONDS = 60.0  # a cell stops early past this (a frame bomb makes every GET wait seconds)


WORST: list[float] = []  # the slowest round trips of the last cell, for --worst


def percentiles(client: Client, tokens, samples: int) -> tuple[float, float, int]:
    times, misses = [], 0
    stop = time.monotonic() + CELL_SECONDS
    for _ in range(samples):
        if time.monotonic() > stop:
            print(f"  (cell cut at {CELL_SECONDS:g} s: {len(times)} samples)", flush=True)
            break
        t0 = time.perf_counter()
        hit = client.get(tokens, max_tokens=300)
        times.append(time.perf_counter() - t0)
        misses += hit is None or hit.n != 300
    WORST[:] = sorted(times)[-20:]
    return float(np.percentile(times, 50)), float(np.percentile(times, 99)), misses


def setup(ep: str, workdir: Path):
    """Store the good client's prefix and 24 big entries; returns (client, tokens, attacks)."""
    path = ep[len("ipc://"):]
    good = Client(ep, namespace="good", timeout=5.0)
    tokens = list(range(300))
    rng = np.random.default_rng(0)
    good.put(tokens, Snapshot(sliced={"k": (HostTensor.from_numpy(rng.integers(0, 255, (1, 300, 160), np.uint8)), 1)}))
    big = Client(ep, namespace="big", timeout=30.0)
    gets = []
    for i in range(24):  # 96 MiB of 4 MiB entries: most live on the SSD tier
        toks = list(range(10_000 + i * 1000, 10_000 + i * 1000 + 256))
        big.put(toks, Snapshot(sliced={"k": (HostTensor.from_numpy(rng.integers(0, 255, (1, 256, 16384), np.uint8)), 1)}))
        gets.append(codec.encode("GET", {"ns": "big", "tokens": keys.token_bytes(toks + [0]), "chunk_tokens": 256}, id=i)[0].hex())
    ping = codec.encode("PING", {}, id=1)[0].hex()
    header = workdir / "header.bin"
    header.write_bytes(msgpack.packb({"v": 1, "type": "PING", "id": 7, "x": [{}] * 4_000_000}))
    lookup = workdir / "lookup.bin"
    lookup.write_bytes(codec.encode("LOOKUP", {"ns": "x", "tokens": keys.token_bytes(range(1 << 20)), "chunk_tokens": 1}, id=3)[0])
    attacks = {
        "ping-flood": (PUMP, ep, "16", ping),
        "idle-conns": (FLOOD, path, "1000"),
        "stalled-frames": (PARTIAL, path, "6", "10", "15"),
        "mute-big-gets": (PUMP, ep, "1", *gets),
        "huge-headers": (HAMMER, ep, str(header)),
        "long-lookups": (HAMMER, ep, str(lookup)),
        "heavy-peers": (HAMMER, ep, str(lookup), "8"),
        "put-storm": (STORM, ep, "4"),
        "churn": (CHURN, ep, "4", ping),
        "tiny-flood": (TINY, ep, "8000"),
        "frame-bomb": (BOMB, path, str(8 << 20)),
        "lane-bomb": (LANE_BOMB, ep, str(8 << 20)),
        "bomb-swarm": (SWARM, path, str(8 << 20), "32"),
        "cpu-hogs": (HOGS, str(os.cpu_count() or 1)),
    }
    return good, tokens + [0], attacks


def remote_for(stack: contextlib.ExitStack):
    """A throwaway redis-server and the daemon arguments that use it as the
    remote tier (a tier key of its own in the server's dir); (None, []) if
    neither redis-server nor valkey-server is installed."""
    from redis_server import RedisServer, redis_binary

    from kvd.endpoint import write_remote_key

    if redis_binary() is None:
        return None, []
    server = RedisServer().start()
    stack.callback(server.close)
    key = server.dir / "remote.key"
    write_remote_key(key)
    return server, ["--remote-url", server.url, "--remote-key-file", str(key)]


def overhead(python: str) -> None:
    """Anonymous RSS per stored zero-byte entry (kvd/store/overhead.py's constants)."""
    from kvd.store.overhead import PER_ENTRY, PER_TENSOR

    print(f"bench_stress --overhead: {machine()}; 102,400 zero-byte entries per row, RAM-only daemon")
    for ntens in (1, 4):
        with daemon("--ram-mb", "4096", "--data-dir", "none", python=python) as d:
            proc = d.proc
            c = Client(d.endpoint, namespace="ovh", chunk_tokens=16, timeout=60.0)
            c.ping()
            before = status(proc.pid, "RssAnon")
            for s in range(25):
                toks = list(range(s * 10**7, s * 10**7 + 16 * 4096))
                zero = HostTensor.from_numpy(np.zeros((1, len(toks), 0), np.uint8))
                c.put(toks, Snapshot(sliced={f"t{j}": (zero, 1) for j in range(ntens)}))
            n = c.stats()["tiers"]["ram"]["entries"]
            grown = (status(proc.pid, "RssAnon") - before) / n
            print(f"{ntens} tensor(s): {n} entries, {grown:.0f} bytes of RSS each; charged {PER_ENTRY + ntens * PER_TENSOR}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--daemon-python", default=sys.executable)
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds each attack runs before measuring")
    ap.add_argument("--only", default="", help="comma-separated attack names")
    ap.add_argument("--worst", action="store_true", help="also print each cell's 20 slowest round trips under attack (ms)")
    ap.add_argument("--overhead", action="store_true", help="measure the RAM tier's per-entry overhead instead")
    ap.add_argument("--floor", action="store_true",
                    help="also time the good client while the attack hits another daemon (the CPU contention floor)")
    args = ap.parse_args()
    if args.overhead:
        return overhead(args.daemon_python)
    print(f"bench_stress: {machine()}; daemon {args.daemon_python}; {args.samples} GETs of a 300-token RAM hit "
          f"per cell; a fresh daemon per attack")
    print(f"{'attack':>15} {'idle p50':>9} {'idle p99':>9} {'p50 ms':>8} {'p99 ms':>8} {'p50 x':>7} {'p99 x':>7} "
          f"{'misses':>7} {'peak MB':>8}" + (f" {'fl p50':>8} {'fl p99':>8} {'fl p99x':>7}" if args.floor else ""))
    names = ["ping-flood", "idle-conns", "stalled-frames", "mute-big-gets", "huge-headers", "long-lookups", "heavy-peers",
             "put-storm", "churn", "tiny-flood", "frame-bomb", "lane-bomb", "bomb-swarm", "paused-remote", "cpu-hogs"]
    ratios: dict[str, float] = {}
    hogs: float | None = None
    for name in args.only.split(",") if args.only else names:
        remote = contextlib.ExitStack()
        extra: list[str] = []
        if name == "paused-remote":
            server, extra = remote_for(remote)
            if server is None:
                print(f"{name:>15} skipped: no redis-server or valkey-server on PATH")
                continue
        with remote, daemon("--ram-mb", "64", "--max-message-mb", "16", *extra, python=args.daemon_python) as d:
            proc = d.proc
            good, tokens, attacks = setup(d.endpoint, d.workdir)
            if name == "paused-remote":
                attacks[name] = (PAUSER, d.endpoint, str(server.proc.pid), "0.3")
            i50, i99, _ = percentiles(good, tokens, args.samples)
            with attack(*attacks[name]):
                time.sleep(args.warmup)  # let the attack reach its steady state (pipes full, ...)
                p50, p99, misses = percentiles(good, tokens, args.samples)
                worst = list(WORST)
                peak = status(proc.pid, "VmHWM") / MiB
            alive = proc.poll() is None
            floor = ""
            if args.floor and name in ("paused-remote", "cpu-hogs"):  # its remote server is this daemon's own; no daemon
                floor = f" {'-':>8} {'-':>8} {'-':>7}"
            elif args.floor:
                # The same attack on another daemon: what the machine's CPUs alone
                # cost the good client (its daemon's thread is not shared).
                with daemon("--ram-mb", "64", "--max-message-mb", "16", python=args.daemon_python) as d2:
                    _, _, other = setup(d2.endpoint, d2.workdir)
                    with attack(*other[name]):
                        time.sleep(args.warmup)
                        f50, f99, _ = percentiles(good, tokens, args.samples)
                floor = f" {f50 * 1e3:8.2f} {f99 * 1e3:8.2f} {f99 / i99:6.1f}x"
            if name == "cpu-hogs":
                hogs = p99 / i99
            else:
                ratios[name] = p99 / i99
            print(f"{name:>15} {i50 * 1e3:9.2f} {i99 * 1e3:9.2f} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {p50 / i50:6.1f}x "
                  f"{p99 / i99:6.1f}x {misses:7d} {peak:8.0f}{floor}{'' if alive else '  DAEMON DIED'}", flush=True)
            if args.worst:
                print(f"{'':>15} slowest ms: {' '.join(f'{t * 1e3:.1f}' for t in worst)}", flush=True)
    print("x: under attack over idle, same daemon (lower is better); fl: the attack on another daemon; misses: GETs that did not come back whole "
          "(a miss after the client's 5 s timeout); peak MB: the daemon's peak RSS")
    if hogs is not None:
        print(f"the machine alone (cpu-hogs, no attack): p99 {hogs:.1f}x idle; an attack whose processes keep the "
              f"cores as busy meets at least that")
    within = [n for n, r in ratios.items() if r <= 2.0]
    print(f"p99 within 2x of idle: {len(within)} of {len(ratios)} attacks ({', '.join(within) or 'none'}); "
          f"over: {', '.join(f'{n} {r:.1f}x' for n, r in ratios.items() if r > 2.0) or 'none'}")


if __name__ == "__main__":
    main()
