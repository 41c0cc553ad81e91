"""The fakes of tests/fakes.py keep the contract of a real client: these tests pin it."""

from __future__ import annotations

import numpy as np
from fakes import FakeClient

from kvd_client._tensors import HostTensor, Snapshot


def _snap(n: int, boundary: bool) -> Snapshot:
    s = Snapshot(meta={"m": 1})
    s.sliced["x"] = (HostTensor.from_numpy(np.arange(n * 2, dtype=np.float32).reshape(1, 1, n, 2)), 2)
    if boundary:
        s.boundary["b"] = HostTensor.from_numpy(np.full((3,), n, dtype=np.int32))
        s.boundary_meta = {"at": n}
    return s


def test_fake_get_trims_to_token_granularity_and_caps():
    c = FakeClient()
    c.put(list(range(10)), _snap(10, False))
    hit = c.get(list(range(8)) + [99, 100], max_tokens=9)
    assert hit.n == 8 and hit.boundary is None
    assert hit.sliced["x"].array.tobytes() == np.arange(16, dtype=np.float32).tobytes()
    assert c.get(list(range(10)), max_tokens=9).n == 9
    assert c.get([5, 6]) is None


def test_fake_boundary_hits_only_where_boundary_state_was_stored():
    c = FakeClient()
    c.put(list(range(6)), _snap(6, True))
    c.put(list(range(10)), _snap(10, True))
    hit = c.get(list(range(9)) + [50], max_tokens=9, need_boundary=True)
    assert hit.n == 6 and hit.boundary_meta == {"at": 6}
    assert c.probe(list(range(12))).boundaries == (6, 10)
    assert c.get(list(range(5)) + [50], need_boundary=True) is None
