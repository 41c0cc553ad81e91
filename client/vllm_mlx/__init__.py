"""kvd as vllm-mlx's cold tier and a prefix cache shared across its processes.

    kvd-vllm-mlx serve MODEL [every vllm-mlx serve flag] [--kvd-endpoint EP]

or, in a program that builds vllm-mlx's engine or `Scheduler` itself:

    import kvd_client.vllm_mlx as kvd_vllm
    kvd_vllm.install()                  # before the scheduler is built
    ... Scheduler(model, tokenizer, SchedulerConfig(...)) ...

Every prefix entry vllm-mlx commits to its RAM cache is also stored in kvd
(write-through), and a request that RAM misses (or covers less than kvd) is
served from kvd, on the engine's thread, with the same cache classes
(quantized stays quantized, rotating stays rotating). See `_prefix` for how,
`_install` for what it checks first.
"""

from kvd_client.vllm_mlx._install import TESTED_VERSION, caches, close_all, install, missing, uninstall

__all__ = ["TESTED_VERSION", "caches", "close_all", "install", "missing", "uninstall"]
