"""`python -m kvd_client.vllm_mlx serve ...`: the same as `kvd-vllm-mlx serve ...`."""

from kvd_client.vllm_mlx.launcher import main

main()
