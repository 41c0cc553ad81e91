"""What the daemon asks of the operating system, one module per concern
(issue 41's host seam): each says what Linux and macOS give, and how kvd
does without where they give nothing. Facts only: what the daemon does with
them (how many peers, when to shed, how far the RAM tier yields) is
decided in kvd.server."""
