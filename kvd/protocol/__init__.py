"""The kvd/1 wire protocol, sans I/O.

Nothing in this package opens a socket or a file: it turns message objects
into frames and frames back into validated message objects, and defines the
key scheme. The daemon and the client both build on it; `proto/PROTOCOL.md`
is its specification and `proto/vectors/` its golden encodings.
"""

from kvd.protocol.dtypes import DTYPES, itemsize
from kvd.protocol.errors import ProtocolError

__all__ = ["DTYPES", "itemsize", "ProtocolError"]
