"""`remote_url`: which forms kvd accepts, and how it is shown without secrets.

Kept apart from remote.py so the settings table can check and redact a URL
without importing the client library: nothing of redis is imported unless
the tier is on.

Rules:
1. The URL is handed to the client library as written, only its scheme
   swapped (as text: re-assembling a parsed URL drops the `//` of
   `unix:///path`, which redis-py then refuses).
2. Redaction works on the text, not on a parse: everything between `://`
   and the LAST `@` of the whole string is the user's (a password holding
   `#`, `/` or `?` ends urlsplit's netloc early, so the parse would show it).
3. `check` refuses a URL whose `@` falls outside the host part (such a
   password must be percent-encoded), and its messages never repeat the URL
   past its scheme.
"""

from __future__ import annotations

from urllib.parse import urlsplit

# Valkey speaks the Redis protocol: its schemes are the Redis ones renamed.
SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}

# Query parameters redis-py reads as credentials.
_SECRET_PARAMS = ("password", "username", "ssl_password")


def check(url: str) -> str:
    """`url` if kvd can use it (scheme and host, or a socket path, present).
    Raises ValueError with a message that never repeats the password."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"not a {', '.join(s + '://' for s in SCHEMES)} URL: {redact(url)}")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError(f"not a URL: {redact(url)}") from None
    if url.count("@") != parts.netloc.count("@"):
        # A password holding '#', '/' or '?' ends the host part early: the
        # client library would read a piece of the password as the host.
        raise ValueError(
            f"an '@' outside the host part of the {scheme}:// URL: a password holding '#', '/', '?' "
            "or '@' must be percent-encoded (%23, %2F, %3F, %40)"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"not a URL: {redact(url)}") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"no socket path in {redact(url)}")
    elif not parts.hostname:
        raise ValueError(f"no host in {redact(url)}")
    return url


def client_url(url: str) -> str:
    """The URL in the form redis-py reads (valkey:// -> redis://, valkeys:// -> rediss://):
    only the scheme changes, the rest is passed on byte for byte."""
    scheme, sep, rest = url.partition("://")
    return SCHEMES[scheme.lower()] + sep + rest


def redact(url: str | None) -> str | None:
    """`url` with its password (and a lone ACL user's token) replaced by ***,
    and secret-looking query parameters hidden: safe to print and log."""
    if url is None:
        return None
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL at all: whatever precedes an '@' may be a secret
        scheme, rest = "", url
    userinfo, at, hostpart = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}:***@{hostpart}" if colon else f"***@{hostpart}"
    base, q, query = rest.partition("?")
    if q:
        shown = []
        for p in query.split("&"):
            name = p.partition("=")[0]
            shown.append(f"{name}=***" if name.lower() in _SECRET_PARAMS else p)
        rest = base + q + "&".join(shown)
    return scheme + sep + rest


def exposed(url: str) -> str:
    """Why a server at `url` is reachable by others in the clear ("" if it is
    not): a non-loopback host without TLS, or without a password. The values
    are signed either way; this is about who can read them and fill the server."""
    import ipaddress
    from urllib.parse import parse_qs

    parts = urlsplit(client_url(url))
    if parts.scheme == "unix":
        return ""
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return ""
    faults = []
    if parts.scheme != "rediss":
        faults.append("no TLS")
    if parts.password is None and "password" not in parse_qs(parts.query):
        faults.append("no AUTH")
    return f"host {host} is not loopback and has {' and '.join(faults)}" if faults else ""
