"""The segment hand-out, sans-I/O (PROTOCOL.md section 15): the lines a
client and the daemon's hand-out service exchange on the plane's `fds`
socket. The fds themselves ride beside a reply (SCM_RIGHTS): that is the
callers' I/O (kvd/server/shm/handout.py, client/_shm.py), not this module's.

    request   b"kvd-fds/1" (b" " segment-name){1..MAX_NAMES} b"\\n"
    reply     b"kvd-fds/1" (b" " ("ok" | "gone")){one per name} b"\\n"
              with one fd attached per "ok", in the order of the names
    refusal   b"kvd-fds/1 error " code b" " NAME b"\\n"   (kvd/1 codes, section 6)

Rules:
1. A request is at most MAX_REQUEST bytes, its newline included; a peer that
   sends more without one is refused TOO_LARGE. Anything else that is not a
   request (not ASCII, another magic, a name not of a segment's form, no
   names, bytes after the newline) is MALFORMED; more than MAX_NAMES names is
   BAD_FIELD. Any garbage either parses or raises one of those, nothing else.
2. "gone": no live segment of that name (removed since, another run's, never
   made). Not an error of the request: the other names are still answered.
3. One request per connection: the service closes after its reply.
"""

from __future__ import annotations

from kvd.protocol.errors import BadField, KvdError, MalformedMessage, MessageTooLarge, ProtocolError, from_code
from kvd.protocol.shm import parse_segment_name

MAGIC = b"kvd-fds/1"
MAX_REQUEST = 1024  # bytes, the newline included: 32 names of 20 characters and room to spare
MAX_NAMES = 32
MAX_REPLY = len(MAGIC) + 1 + 5 * MAX_NAMES + 64  # "gone" per name, or a refusal with its name
OK, GONE = "ok", "gone"


def encode_request(names: list[str]) -> bytes:
    """A request for these segments' fds. BadField for no name, too many, or
    one that is not a segment's name (a local mistake, caught before sending)."""
    if not 1 <= len(names) <= MAX_NAMES or any(parse_segment_name(n) is None for n in names):
        raise BadField(f"a hand-out request names 1 to {MAX_NAMES} segments, got {names!r}")
    return MAGIC + b"".join(b" " + n.encode("ascii") for n in names) + b"\n"


def request_line(buf: bytes | bytearray) -> bytes | None:
    """The request line in what a peer sent so far, or None if more must come.
    MessageTooLarge once MAX_REQUEST bytes hold no newline; MalformedMessage
    for bytes after it (rule 3: one request per connection)."""
    end = buf.find(b"\n")
    if end < 0:
        if len(buf) >= MAX_REQUEST:
            raise MessageTooLarge(f"a hand-out request is at most {MAX_REQUEST} bytes with its newline")
        return None
    if end + 1 > MAX_REQUEST:
        raise MessageTooLarge(f"a hand-out request is at most {MAX_REQUEST} bytes with its newline")
    if end + 1 != len(buf):
        raise MalformedMessage("bytes after a hand-out request: one request per connection")
    return bytes(buf[:end])


def parse_request(line: bytes) -> list[str]:
    """The segment names a request line (without its newline) asks for."""
    parts = line.split(b" ")
    if parts[0] != MAGIC:
        raise MalformedMessage("not a kvd-fds/1 request")
    names = parts[1:]
    if not names:
        raise MalformedMessage("a hand-out request names no segment")
    if len(names) > MAX_NAMES:
        raise BadField(f"a hand-out request names at most {MAX_NAMES} segments, got {len(names)}")
    try:
        out = [n.decode("ascii") for n in names]
    except UnicodeDecodeError:
        raise MalformedMessage("a hand-out request is ASCII") from None
    for n in out:
        if parse_segment_name(n) is None:
            raise MalformedMessage(f"{n[:40]!r} is not a segment's name")
    return out


def encode_reply(statuses: list[str]) -> bytes:
    """The reply: one status per name asked, OK or GONE."""
    assert statuses and all(s in (OK, GONE) for s in statuses)
    return MAGIC + b"".join(b" " + s.encode() for s in statuses) + b"\n"


def encode_refusal(err: ProtocolError) -> bytes:
    """A refusal of a whole request, carrying a kvd/1 error's code and name."""
    return MAGIC + f" error {err.code} {err.name}\n".encode()


def parse_reply(data: bytes, asked: int) -> list[str]:
    """The statuses of a reply to a request of `asked` names. Raises the
    error a refusal names (kvd.protocol.errors), or MalformedMessage for a
    reply that is neither."""
    if not data.endswith(b"\n") or len(data) > MAX_REPLY:
        raise MalformedMessage("a hand-out reply is one line")
    parts = data[:-1].split(b" ")
    if parts[0] != MAGIC:
        raise MalformedMessage("not a kvd-fds/1 reply")
    if len(parts) == 4 and parts[1] == b"error" and parts[2].isdigit():
        err: KvdError = from_code(int(parts[2]), f"the hand-out refused the request ({parts[3].decode('ascii', 'replace')})")
        raise err
    statuses = [p.decode("ascii", "replace") for p in parts[1:]]
    if len(statuses) != asked or any(s not in (OK, GONE) for s in statuses):
        raise MalformedMessage(f"a hand-out reply has one status per name asked ({asked}): {data[:80]!r}")
    return statuses
