"""Where chunks live: the store interface and its tiers.

`base` defines what every tier holds (`Entry`, `Tensor`) and promises (`Store`);
`ram` is the byte-budgeted LRU tier. The server talks only to a `Store`, so a
tier stacked in front of another (RAM over SSD) is just another `Store`.
Nothing here knows about sockets or the wire format.
"""

from kvd.store.base import BOUNDARY, CHUNK, Entry, PutOutcome, Store, Tensor, entry_id
from kvd.store.datadir import DataDirBusy
from kvd.store.ssd.index import IncompatibleIndex
from kvd.store.ram import RamStore
from kvd.store.ssd import SsdStore
from kvd.store.tiered import TieredStore, open_store

__all__ = [
    "BOUNDARY", "CHUNK", "Entry", "PutOutcome", "Store", "Tensor", "entry_id",
    "RamStore", "SsdStore", "TieredStore", "open_store", "DataDirBusy", "IncompatibleIndex",
]
