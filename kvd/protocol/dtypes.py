"""The dtype table: the names a tensor may carry on the wire, and their sizes.

A tensor travels as (dtype name, shape, raw little-endian bytes). The name is
the contract; numpy is only a convenient container on either side. bfloat16
has no numpy dtype, so its bytes ride in a uint16 container while the name
stays "bfloat16" -- it is never upcast, downcast or passed through numpy's
buffer protocol under a float name.
"""

from __future__ import annotations

import numpy as np

# name -> (itemsize in bytes, numpy container dtype for the raw bytes).
# The container has the same itemsize and is what a numpy-level caller sees;
# for every dtype but bfloat16 it is the dtype itself.
DTYPES: dict[str, tuple[int, np.dtype]] = {
    "bfloat16": (2, np.dtype("<u2")),
    "float16": (2, np.dtype("<f2")),
    "float32": (4, np.dtype("<f4")),
    "float64": (8, np.dtype("<f8")),
    "uint8": (1, np.dtype("u1")),
    "int8": (1, np.dtype("i1")),
    "uint16": (2, np.dtype("<u2")),
    "int16": (2, np.dtype("<i2")),
    "uint32": (4, np.dtype("<u4")),
    "int32": (4, np.dtype("<i4")),
    "uint64": (8, np.dtype("<u8")),
    "int64": (8, np.dtype("<i8")),
    "bool": (1, np.dtype("?")),
}

# numpy dtype -> wire name, for arrays whose dtype is their own name.
_FROM_NUMPY = {np.dtype(name): name for name in DTYPES if name != "bfloat16"}


def itemsize(name: str) -> int:
    """Bytes per element of the wire dtype `name`; KeyError if unknown."""
    return DTYPES[name][0]


def container(name: str) -> np.dtype:
    """The numpy dtype that holds `name`'s raw bytes (uint16 for bfloat16)."""
    return DTYPES[name][1]


def name_of(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype; ValueError if it cannot travel.

    Big-endian arrays are refused rather than silently byte-swapped.
    """
    try:
        return _FROM_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"numpy dtype {dtype} has no kvd wire name") from None
