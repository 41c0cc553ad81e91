"""Exit codes of every kvd command (documented in `kvd --help` and the README)."""

OK = 0  # done
FAILED = 1  # the command ran and failed (see its message)
USAGE = 2  # bad flags or arguments (click's own code)
UNAVAILABLE = 3  # no daemon answered at the endpoint
REFUSED = 4  # the daemon answered with an error, or is already running (serve)
CONFIG = 78  # bad configuration (sysexits EX_CONFIG): service managers stop restarting
