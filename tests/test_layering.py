"""The architecture's rules, checked: the daemon never loads mlx; the
protocol layer does no I/O; the client's public surface is pinned."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

import kvd_client
from test_daemon import prefix_snapshot

ROOT = Path(__file__).resolve().parent.parent


def test_a_serving_daemon_never_loads_mlx(daemon_factory):
    d = daemon_factory("--ram-mb", "1", "--metrics-port", "0")
    with d.client("layers", strict=True) as c:  # exercise spill, promotion, stats
        for i in range(8):
            s = np.arange(512) + 1000 * i
            assert c.put(s, prefix_snapshot(s))
            assert c.get(s).n == 512
        c.stats()
    maps = Path(f"/proc/{d.proc.pid}/maps")
    if maps.exists():
        assert "mlx" not in maps.read_text()


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_daemon_package_never_imports_mlx():
    # `kvd import/export` reach mlx only through the client's own modules
    # (kvd_client.mlx_lm_files), imported inside the commands.
    for path in (ROOT / "kvd").rglob("*.py"):
        bad = {m for m in imports_of(path) if m == "mlx" or m.startswith(("mlx.", "mlx_lm"))}
        assert not bad, (path, bad)


def test_protocol_layer_does_no_io():
    for path in (ROOT / "kvd" / "protocol").rglob("*.py"):
        bad = {m for m in imports_of(path) if m.split(".")[0] in {"zmq", "socket", "os", "lmdb", "kvd"} and not m.startswith("kvd.protocol")}
        assert not bad, (path, bad)


def test_client_public_surface_is_pinned():
    assert sorted(kvd_client.__all__) == sorted([
        "Client", "Probe", "Snapshot", "Hit", "HostTensor", "KvdError", "ProtocolError", "ServerError",
        "DaemonUnavailable", "BadReply", "MediaSpan", "media_digest",
    ])
    public = {n for n in dir(kvd_client.Client) if not n.startswith("_")}
    assert {"put", "get", "probe", "store", "fetch", "lookup", "stats", "gc", "ping", "close"} <= public
