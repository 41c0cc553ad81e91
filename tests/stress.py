"""Hostile peers for the stress suite and bench/bench_stress.py.

Each attack is a separate process (its own fds and memory) that does its
damage, prints one line when done, then holds its connections until its
stdin closes: `with attack(...):` runs the body while the attack is held.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator

# Raw connections, as fast as the daemon takes them (a connect waits while the
# listener's backlog is full, at most 10 s); never a byte sent. Says how many,
# then holds them until its stdin closes.
FLOOD = r"""
import socket, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 10, 0))
    try:
        s.connect(path)
    except OSError:
        s.close()
        continue
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()
"""

# N peers, each a ZMTP 3.0 DEALER by hand: a message of K frames of F MiB,
# all but its last byte, then silence (libzmq holds the parts it received).
PARTIAL = r"""
import socket, struct, sys
path, n, k, f = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) << 20
chunk = bytes(1 << 20)
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(16) + b"\x00" + bytes(31))
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    try:
        for j in range(k):
            last = j == k - 1
            s.sendall(bytes([0x02 if last else 0x03]) + struct.pack(">Q", f))
            todo = f - 1 if last else f
            while todo:
                m = min(todo, len(chunk))
                s.sendall(chunk[:m])
                todo -= m
    except OSError:
        pass  # shed by the daemon mid-way: what it is for
    held.append(s)
print(n, flush=True)
sys.stdin.read()
"""

# ZMTP 3.0 by hand over AF_UNIX, for the frame-bomb scripts here, in
# tests/server/test_lanes.py and in bench/bench_stress.py (pyzmq's
# send_multipart takes ~18 s for 8 M frames): `zmtp_connect(path)` makes the
# greeting (NULL mechanism) and READY as a DEALER, and returns the socket and
# a reader past the daemon's greeting; `zmtp_bomb(header, f)` is one message
# of the header then f empty frames (16 MB on the wire for 8 M);
# `zmtp_reply(r)` reads a reply and gives its error name (or type), "EOF" if
# the daemon cut the connection.
ZMTP = r"""
import msgpack, socket, struct

def zmtp_connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(16) + b"\x00" + bytes(31))
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    r = s.makefile("rb")
    r.read(64)  # the daemon's greeting
    return s, r

def zmtp_bomb(header, f):
    return bytes([1, len(header)]) + bytes(header) + b"\x01\x00" * (f - 1) + b"\x00\x00"

def _zmtp_frame(r):
    flags = r.read(1)
    if not flags:
        return None
    n = r.read(1)[0] if not flags[0] & 2 else struct.unpack(">Q", r.read(8))[0]
    return flags[0], r.read(n)

def zmtp_bombs(s, r, bomb, m):
    # `bomb` sent up to m times on one connection, each followed by its
    # answer; the answers' names ("EOF": the daemon cut the connection).
    out = []
    for _ in range(m):
        try:
            s.sendall(bomb)
        except OSError:
            out.append("EOF")
            break
        out.append(zmtp_reply(r))
    return out

def zmtp_reply(r):
    try:
        while True:  # commands (READY), then the reply's frames
            got = _zmtp_frame(r)
            if got is None:
                return "EOF"
            flags, body = got
            if not flags & 4 and not flags & 1:
                got = msgpack.unpackb(body)
                return got.get("name") or got.get("type", "?")
    except (OSError, IndexError, struct.error):
        return "EOF"
"""

# Frame bombs: a ZMTP DEALER by hand sends M messages, each the given header
# (hex) and then F empty frames, one sendall each, and after each waits for
# the reply. Prints, on one line, per message the reply's error name (or
# "EOF": the daemon cut the connection), then "again:" and what a new
# connection's PING got; with a fifth argument "split", "again: ..." on a
# line of its own (a connection held unread waits for it until killed).
BOMB = ZMTP + r"""
import sys
path, m, f, header = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), bytes.fromhex(sys.argv[4])
bomb = zmtp_bomb(header, f)
s, r = zmtp_connect(path)
out = zmtp_bombs(s, r, bomb, m)
if sys.argv[5:] == ["split"]:
    print(" ".join(out), flush=True)
    out = []
s2, r = zmtp_connect(path)
try:
    s2.sendall(bytes([0, len(header)]) + header)
except OSError:
    pass
out += ["again:", zmtp_reply(r)]
print(" ".join(out), flush=True)
sys.stdin.read()
"""

# N DEALERs that each send M rounds of the given one-frame requests (hex)
# and never read a reply.
MUTE = r"""
import sys, zmq
ep, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
msgs = [bytes.fromhex(h) for h in sys.argv[4:]]
ctx = zmq.Context()
socks = []
for _ in range(n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    socks.append(s)
for _ in range(m):
    for s in socks:
        for msg in msgs:
            s.send(msg)
print(n * m * len(msgs), flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def attack(script: str, *args: str) -> Iterator[str]:
    """Run an attack; yields its line once its damage is done; ends it on exit."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def status(pid: int, field: str) -> int:
    """A byte count from /proc/<pid>/status (RssAnon, VmHWM, ...)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

# N DEALERs that send the given one-frame requests (hex) in a loop, never
# reading a reply, until stdin closes: a flood that lasts. Like a client that
# stopped reading, a pump whose sends all fail waits until one could go (here
# in a poll) instead of spinning: a spinning pump is a CPU hog on top of the
# flood, which costs the machine a core whatever the daemon does.
PUMP = r"""
import sys, zmq
ep, n = sys.argv[1], int(sys.argv[2])
msgs = [bytes.fromhex(h) for h in sys.argv[3:]]
ctx = zmq.Context()
socks = []
poller = zmq.Poller()
poller.register(0, zmq.POLLIN)  # stdin: closed when the attack ends
for _ in range(n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.SNDHWM, 64)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    socks.append(s)
    poller.register(s, zmq.POLLOUT)
print(n, flush=True)
sent = 0
while True:
    before = sent
    for s in socks:
        for msg in msgs:
            try:
                s.send(msg, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
    if 0 in dict(poller.poll(0 if sent != before else 1000)):
        break
"""

# N peers that each connect, send one request (hex), read the reply and hang
# up, again and again until stdin closes: every request on a new connection.
CHURN = r"""
import select, sys, threading, zmq
ep, n, msg = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
ctx = zmq.Context()
stop = threading.Event()
def churn():
    while not stop.is_set():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 1000)
        s.connect(ep)
        s.send(msg)
        try:
            s.recv_multipart()
        except zmq.Again:
            pass
        s.close()
threads = [threading.Thread(target=churn) for _ in range(n)]
for t in threads:
    t.start()
print(n, flush=True)
select.select([sys.stdin], [], [])
stop.set()
for t in threads:
    t.join(10)
"""

# N clients (default 1) that ask the same request again and again and read
# every reply: expensive requests (huge headers, long LOOKUPs) sent as fast
# as answered.
HAMMER = r"""
import select, sys, zmq
ep = sys.argv[1]
msg = open(sys.argv[2], "rb").read()  # one frame, from a file (it may be megabytes)
n = int(sys.argv[3]) if len(sys.argv) > 3 else 1
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(n)]
for s in socks:
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    for s in socks:
        s.send(msg, copy=False)
    for s in socks:
        s.recv_multipart()
"""

# N clients that each PUT new 1,024-token prompts of small chunks (4 x 256
# tokens of 16 KiB) as fast as they are answered, until stdin closes: more
# new data than the disk can write behind.
STORM = r"""
import multiprocessing as mp, select, sys
import numpy as np
from kvd_client import Client, HostTensor, Snapshot

def storm(ep, seed, stop):
    snap = Snapshot(sliced={"k": (HostTensor.from_numpy(np.full((1, 1024, 16), seed, np.uint8)), 1)})
    with Client(ep, namespace=f"storm{seed}", timeout=10, chunk_tokens=256) as c:
        i = 0
        while not stop.is_set():
            c.put([seed, i, 7] * 341 + [seed], snap)
            i += 1

if __name__ == "__main__":
    ep, n = sys.argv[1], int(sys.argv[2])
    ctx = mp.get_context("fork")  # a -c script: spawn could not re-import it
    stop = ctx.Event()
    procs = [ctx.Process(target=storm, args=(ep, k, stop)) for k in range(n)]
    for p in procs:
        p.start()
    print(n, flush=True)
    select.select([sys.stdin], [], [])
    stop.set()
    for p in procs:
        p.join(30)
"""
