"""`remote_url`: which forms kvd accepts, and how it is shown without secrets.

Kept apart from remote.py so the settings table can check and redact a URL
without importing the client library: nothing of redis is imported unless
the tier is on.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

# Valkey speaks the Redis protocol: its schemes are the Redis ones renamed.
SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}


def check(url: str) -> str:
    """`url` if kvd can use it (scheme and host present). Raises ValueError
    with a message that never repeats the password."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"not a URL: {redact(url)}") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"scheme {parts.scheme!r} is not one of {', '.join(s + '://' for s in SCHEMES)}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"no host in {redact(url)}")
    return url


def client_url(url: str) -> str:
    """The URL in the form redis-py reads (valkey:// -> redis://, valkeys:// -> rediss://)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=SCHEMES[parts.scheme]))


def redact(url: str | None) -> str | None:
    """`url` with its password (and a lone ACL user's token) replaced by ***,
    and secret-looking query parameters hidden: safe to print and log."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else "***"
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = "&".join(
        (p.split("=", 1)[0] + "=***") if p.split("=", 1)[0].lower() in ("password", "username", "ssl_password") else p
        for p in parts.query.split("&") if p
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))
