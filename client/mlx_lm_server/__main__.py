"""`python -m kvd_client.mlx_lm_server`: mlx_lm.server with kvd as its prompt cache."""

from kvd_client.mlx_lm_server.launcher import main

main()
