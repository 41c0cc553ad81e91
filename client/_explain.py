"""`Client.explain(tokens)`: ask the daemon why a sequence is (not) cached.

The daemon does the work (kvd/server/explain.py); this module builds the
EXPLAIN request and wraps the reply. Two things only the client knows go
with it: whether the model needs boundary state (hybrid and sliding-window
models resume only where a stored sequence ended; the layout is known once
`namespace_for` or a store/fetch has seen the model), and the namespace's
component metadata, so the daemon can name the field in which two
namespaces differ. `namespace_for` registers those components here
(`remember`), and every PUT of that namespace carries them (`ns_meta`, a
field old daemons ignore).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

_lock = threading.Lock()
_components: dict[str, dict[str, Any]] = {}


def remember(namespace: str, components: dict[str, Any]) -> None:
    """Record what a namespace id was made from (`namespace_for` calls this)."""
    with _lock:
        _components[namespace] = components


def components_for(namespace: str) -> dict[str, Any] | None:
    with _lock:
        return _components.get(namespace)


@dataclass(frozen=True, slots=True)
class Explanation:
    """How far the daemon holds a sequence (`n` of `tokens`) and why it stops.

    `reason` is one of: held, boundary_missing, evicted, quarantined,
    other_namespace, tokens_differ, never_stored (proto/PROTOCOL.md,
    EXPLAIN); `message` says it in a sentence; `detail` has the specifics
    (e.g. `at`, `tier`, `why`, `when`, `namespace`, `fields`).
    """

    n: int
    tokens: int
    reason: str
    message: str
    boundaries: tuple[int, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def explain(client: Any, tokens: Sequence[int], need_boundary: bool, media: Sequence[Any] = ()) -> Explanation | None:
    """Ask `client`'s daemon about `tokens` (with their `media` spans) in
    `client.namespace`; None if it did not answer (or cannot key media)."""
    seq = client._seq(tokens, media)
    if seq is None:
        return None
    fields = {**seq, "need_boundary": need_boundary, "ns_meta": components_for(client.namespace)}
    reply = client._call("EXPLAIN", fields)
    if reply is None:
        return None
    return Explanation(reply["n"], reply["tokens"], reply["reason"], reply["message"], tuple(reply["boundaries"]),
                       dict(reply.get("detail") or {}))
