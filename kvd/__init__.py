"""kvd: an out-of-process KV-cache daemon for MLX inference servers.

This package is the daemon side: the sans-I/O wire protocol (`kvd.protocol`),
the tiers that hold chunks (`kvd.store`), the ZeroMQ server (`kvd.server`) and
the command line (`kvd.cli`). It never imports mlx.
"""

__version__ = "0.1.0"
