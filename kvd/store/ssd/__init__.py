"""The SSD tier: entries as blobs under a data dir, indexed by LMDB.

`SsdStore` (store.py) is the tier; its docstring is the theory of operation
and names the room each concern lives in. The tier's parts, from the
bottom up:

  blobfile.py   one entry <-> one safetensors file: crash-safe write, checked read
  lmdbenv.py    an LMDB environment that survives resizes and files replaced under it
  index.py      the rows: what is on disk, in what recency order
  pack.py       small blobs together in one LMDB
  spill.py      the bounded queue and the single writer thread
  heal.py       a damaged index moved aside and rebuilt from the blobs
  reconcile.py  leftovers of a crash removed: temp files, orphans, rows without blobs
  check.py      does the index agree with the blobs (`kvd verify`)
  offline.py    the data dir with no daemon running (`kvd stats`, `kvd gc`)
"""

from kvd.store.ssd.budget import DEFAULT_MIN_FREE
from kvd.store.ssd.store import SsdStore

__all__ = ["DEFAULT_MIN_FREE", "SsdStore"]
