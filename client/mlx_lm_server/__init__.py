"""kvd as the prompt cache of the stock mlx-lm HTTP server.

    python -m kvd_client.mlx_lm_server --model PATH --port 8080 [mlx_lm.server flags]
        [--kvd-endpoint EP] [--kvd-timeout S] [--no-kvd]

`KvdPromptCache` is the cache class (mlx-lm's `LRUPromptCache` interface, a
local LRU in front of kvd); `install(mlx_lm.server, ...)` makes the server
construct it; `launcher.main` is the command line.
"""

from kvd_client.mlx_lm_server.launcher import install, main
from kvd_client.mlx_lm_server.prompt_cache import KvdPromptCache, ModelRef

__all__ = ["KvdPromptCache", "ModelRef", "install", "main"]
