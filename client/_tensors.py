"""Host-side tensors and snapshots: what the client core moves, in numpy terms.

A `HostTensor` is a wire dtype name plus a C-contiguous numpy array that holds
its raw bytes. For every dtype but bfloat16 the array's dtype *is* the wire
dtype; a bfloat16 tensor rides in a uint16 array (numpy has no bfloat16), and
its name keeps saying "bfloat16" all the way to the other side.

A `Snapshot` is one model's cache for a token sequence, as the client core
cuts it into chunks:

* `sliced`   -- tensors with a token axis (KV data, quantized packed data,
                scales, biases): cut along that axis at chunk boundaries;
* `boundary` -- state without a token axis (recurrent/SSM state, a rotated
                sliding window): valid only at the end of the sequence, so it
                is attached to the chunk where the sequence ends;
* `meta` / `boundary_meta` -- small msgpack-able maps (layout, scalars) that
                travel with every chunk / with the boundary state;
* `start`    -- the token position of the sliced tensors' first row (0, or
                a chunk boundary when leading chunks are already stored).

A `Hit` is what comes back: the sliced tensors re-joined and trimmed to the
`n` tokens served, plus the boundary state if the hit ends on a boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvd.protocol import dtypes


@dataclass(frozen=True, slots=True)
class HostTensor:
    """A wire dtype name and a C-contiguous numpy array holding its bytes."""

    dtype: str
    array: np.ndarray

    def __post_init__(self) -> None:
        if self.dtype not in dtypes.DTYPES:
            raise ValueError(f"unknown kvd dtype {self.dtype!r}")
        if self.array.dtype.itemsize != dtypes.itemsize(self.dtype):
            raise ValueError(
                f"{self.dtype} needs a container of itemsize {dtypes.itemsize(self.dtype)}, got {self.array.dtype}"
            )

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "HostTensor":
        """Wrap a numpy array whose dtype is its own wire dtype (not bfloat16)."""
        return cls(dtypes.name_of(array.dtype), np.ascontiguousarray(array))

    @classmethod
    def bfloat16(cls, bits: np.ndarray) -> "HostTensor":
        """Wrap the raw bits of a bfloat16 tensor, held in a uint16 array."""
        return cls("bfloat16", np.ascontiguousarray(bits.view(np.uint16)))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def equal(self, other: "HostTensor") -> bool:
        """Bit-exact equality: same dtype name, shape and bytes."""
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and self.array.tobytes() == other.array.tobytes()
        )


@dataclass(slots=True)
class Snapshot:
    """A cache for a token sequence, ready to be cut into chunks (see module doc)."""

    sliced: dict[str, tuple[HostTensor, int]] = field(default_factory=dict)  # name -> (tensor, token axis)
    boundary: dict[str, HostTensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    boundary_meta: dict[str, Any] = field(default_factory=dict)
    # Token position of the sliced tensors' first row: a snapshot may leave
    # out leading chunks the daemon already holds (a chunk boundary).
    start: int = 0
    # Media spans of the sequence (kvd_client._media), part of its keys.
    media: tuple = ()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t, _ in self.sliced.values()) + sum(t.nbytes for t in self.boundary.values())


@dataclass(slots=True)
class Hit:
    """A served prefix: `n` tokens of sliced tensors, boundary state if any."""

    n: int
    sliced: dict[str, HostTensor]
    axes: dict[str, int]
    boundary: dict[str, HostTensor] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    boundary_meta: dict[str, Any] = field(default_factory=dict)
