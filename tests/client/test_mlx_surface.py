"""The public surface of kvd_client.mlx_lm, and what importing it costs."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import kvd_client.mlx_lm as mlx_lm
from fakes import FakeClient

CLIENT = Path(mlx_lm.__file__).resolve().parent


def test_public_surface_is_pinned():
    assert sorted(mlx_lm.__all__) == [
        "FORMAT", "MlxAdapter", "MlxMethods", "SnapshotMismatch", "UnsupportedCache", "namespace_for", "rebuild", "snapshot",
        "weights_digest",
    ]


def test_importing_the_client_does_not_import_mlx():
    code = "import sys, kvd_client, kvd_client.mlx_lm; print('mlx' in sys.modules or 'mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_writer_module_cannot_reach_mlx():
    src = (CLIENT / "_writer.py").read_text()
    assert "import mlx" not in src and "from mlx" not in src


def test_dropped_client_stops_its_writer_thread():
    # Its own thread, not a count of every "kvd-writer": an earlier test's
    # client still waiting for the collector ends at the same gc.collect().
    kv = FakeClient("drop")
    thread = kv._mlx_writer()._thread  # started
    assert thread.name == "kvd-writer" and thread.is_alive()
    del kv
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_client_composes_the_mlx_adapter_instead_of_inheriting_it():
    # The numpy core never depends on the mlx layer: Client holds an adapter,
    # made on first use, and close() drains its writer before the sockets.
    from kvd_client import Client

    assert not issubclass(Client, mlx_lm.MlxMethods)
    kv = Client("ipc:///tmp/kvd-surface-none.sock", namespace="surface", timeout=0.2)
    assert kv._mlx is None
    assert isinstance(kv.mlx, mlx_lm.MlxAdapter) and kv.mlx is kv.mlx
    assert kv.mlx.namespace == "surface" and kv.mlx.counters is kv.counters
    kv.close()
