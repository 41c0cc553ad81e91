"""Running kvd as a per-user service.

Read in this order:
- `notify`: systemd readiness and watchdog messages (the daemon calls it).
- `launchd`: the macOS agent plist, built as data.
- `systemd`: the Linux user unit, a template rendered for one interpreter.
- `install`: plans and applies install / uninstall / status for either.

The service files in the repository's launchd/ and systemd/ folders are these
modules' output for example paths; tests keep them identical.
"""

from kvd.service.notify import Notifier

__all__ = ["Notifier"]
