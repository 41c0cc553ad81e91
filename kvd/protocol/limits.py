"""Protocol limits: what a daemon accepts, advertised to clients in HELLO."""

from __future__ import annotations

from dataclasses import asdict, dataclass

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int = 512 * MiB  # all frames of one message together
    max_header_bytes: int = 16 * MiB  # frame 0 alone
    max_frames: int = 65536  # header included
    max_tokens: int = 1 << 20  # token ids in one sequence
    max_rank: int = 8  # dimensions of one tensor
    max_namespace_bytes: int = 256  # UTF-8 bytes of a namespace id
    max_meta_bytes: int = 64 * 1024  # one chunk's or boundary's meta
    max_chunk_tokens: int = 65536  # largest chunk size a namespace may use
    max_chunks: int = 8192  # chunks one sequence message may span (bounds a request's work)

    @property
    def max_header_objects(self) -> int:
        """Maps and arrays one header may hold (derived, not advertised): a PUT
        needs about two per chunk and two per tensor, and tensors are at most
        `max_frames`. Bounds what decoding a header can cost in memory."""
        return 4 * self.max_frames + 4096

    @property
    def max_header_items(self) -> int:
        """Array elements and map entries one header may hold, all its
        containers together (derived, not advertised). A PUT needs ~10 per
        tensor (its map's entries, its shape: ~14 at `max_rank`) and a few per
        chunk. Without this bound a 16 MiB header of arrays of two-byte
        strings decoded to ~330 MB (each string an object, ~60 bytes with its
        slot); with it a header costs at most ~70 MB however it is filled."""
        return 16 * (self.max_frames + self.max_chunks)

    def to_wire(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_wire(cls, fields: dict) -> "Limits":
        """Known keys from a HELLO reply's `limits` map; unknown keys ignored."""
        known = {k: int(v) for k, v in fields.items() if k in cls.__dataclass_fields__ and isinstance(v, int)}
        return cls(**known)


DEFAULT_LIMITS = Limits()
