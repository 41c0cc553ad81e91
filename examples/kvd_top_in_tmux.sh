#!/usr/bin/env bash
# Try `kvd top` in a real terminal without touching your own daemon:
#
#   examples/kvd_top_in_tmux.sh            # prints two screens of the live view, then cleans up
#
# It starts a throwaway daemon (RAM 8 MiB, a temp data dir, a synthetic
# memory-pressure file), stores some sequences, opens `kvd top` in a detached
# tmux session, flips the pressure file to "critical" so the RAM tier yields,
# and prints what the terminal shows before and after. Needs tmux
# (apt-get install tmux / brew install tmux) and the repo's .venv (./dev test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
work=$(mktemp -d /tmp/kvd-top-XXXXXX)
ep="ipc://$work/kvd.sock"
sock="kvd-top-$$"
cleanup() { tmux -L "$sock" kill-server 2>/dev/null || true; $PY -m kvd stop --endpoint "$ep" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT
$PY -m kvd serve --endpoint "$ep" --data-dir "$work/data" --ram-mb 8 --ram-floor-mb 1 \
    --pressure-source "file:$work/pressure" --pressure-poll-s 0.2 --pressure-calm-s 5 >"$work/log" 2>&1 &
$PY - "$ep" <<'PYEOF'
import sys, time
import numpy as np
from kvd_client import Client, HostTensor, Snapshot
ep = sys.argv[1]
deadline = time.monotonic() + 20
with Client(ep, namespace="example-model") as kv:
    while kv.ping() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    for i in range(12):
        tokens = np.arange(1024) + 10_000 * i
        kv.put(tokens, Snapshot(sliced={"k": (HostTensor.from_numpy(np.full((1, 4, 1024, 64), i, np.float16)), 2)}))
        kv.get(tokens)
PYEOF
tmux -L "$sock" new-session -d -s top -x 150 -y 45 "$PY -m kvd top --endpoint $ep --interval 0.5"
sleep 1.5
echo "=== kvd top, no pressure ==="; tmux -L "$sock" capture-pane -p -t top
echo critical > "$work/pressure"
sleep 2
echo "=== kvd top, after the pressure file says critical ==="; tmux -L "$sock" capture-pane -p -t top
tmux -L "$sock" send-keys -t top q
