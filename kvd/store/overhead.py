"""What holding an entry in the RAM tier costs the process beyond its bytes.

An entry is a dataclass, its key and id, a tuple of tensors (each a small
object with a dtype name, a shape tuple and a buffer or ZeroMQ frame), its
meta, and a slot in each of the RAM tier's maps. None of that is in
`Entry.nbytes`, and for small entries it dominates: 1.95 M zero-byte
entries once held 958 MB under a 16 MiB budget that said 0 bytes were used.

Measured on CPython 3.11 (Linux, x86-64) through a real daemon: the growth
of anonymous RSS per stored entry, for entries of 1 and 4 zero-byte
tensors (102,400 entries each; `bench/bench_stress.py --overhead` repeats
the measurement): 912-965 and 1,735-1,865 bytes over two runs, i.e. ~670
per entry + ~300 per tensor. The constants below round these up.
"""

from __future__ import annotations

from kvd.store.base import Entry

PER_ENTRY = 704
PER_TENSOR = 320


def entry_overhead(entry: Entry) -> int:
    """Bytes of process memory an entry costs besides `entry.nbytes`."""
    return PER_ENTRY + PER_TENSOR * len(entry.tensors)
