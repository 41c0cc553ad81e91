"""`Hit` -> mlx-lm prompt cache, on the caller's thread.

Theory of operation
-------------------
`rebuild(hit)` reads the layer specs from `hit.meta` (see `_format`), makes
one fresh mlx-lm cache object per layer with its constructor, and fills in
explicit attributes. Every array is created here: a sliced tensor that
`fetch` joined straight into mlx memory (`_blocks`) as a view of it, any
other from the hit's numpy bytes (`mx.array` copies on the CPU build, so the
hit's buffers -- possibly received ZeroMQ frames -- can be dropped right
after), bfloat16 by viewing uint16 bits; the lot is evaluated with one
`mx.eval` on the caller's stream, so the first forward pass does not pay for
it and nothing lazy escapes to another thread.

Sliced layers get `offset = hit.n` (the RoPE position of the next token);
boundary layers get the scalars stored with their state, and must agree that
they describe exactly `hit.n` tokens. Buffers are exactly `n` rows long: the
cache classes grow them on the next update as they would any buffer.

Anything that does not fit -- unknown format, a missing tensor, a token axis
of the wrong length -- raises SnapshotMismatch; the caller treats it as a miss.
"""

from __future__ import annotations

from typing import Any


from kvd_client._tensors import Hit, HostTensor
from kvd_client.mlx_lm import _format as F

_FLOATS = frozenset({"float16", "bfloat16", "float32"})


def rebuild(hit: Hit, blocks: dict[int, Any] | None = None) -> list[Any]:
    """A list of mlx-lm cache objects covering `hit.n` tokens; SnapshotMismatch if unusable.

    `blocks`: the mlx uint8 arrays the hit's sliced tensors were joined into,
    by the address of their memory (`MlxMethods.fetch` passes them, see
    `_blocks.mlx_blocks`); those tensors become views of them, with no
    second copy.
    """
    import mlx.core as mx

    layers = _layers(hit.meta)
    try:
        if F.needs_boundary(layers) and hit.boundary is None:
            raise F.SnapshotMismatch("the model has recurrent/windowed layers but the hit carries no boundary state")
        b = _Builder(hit, blocks)
        caches = [b.layer(str(i), spec) for i, spec in enumerate(layers)]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
        # Any process of the user may have written this entry: meta that does
        # not describe a cache kvd makes is unusable, never an error to raise.
        raise F.SnapshotMismatch(f"snapshot meta does not describe its layers ({type(exc).__name__}: {exc})") from None
    mx.eval(*b.arrays)
    return caches


def _layers(meta: dict[str, Any]) -> list[dict[str, Any]]:
    if not isinstance(meta, dict) or meta.get("fmt") != F.FORMAT:
        raise F.SnapshotMismatch(f"not a kvd mlx snapshot of format {F.FORMAT}: fmt={meta.get('fmt') if isinstance(meta, dict) else None!r}")
    layers = meta.get("layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(spec, dict) for spec in layers):
        raise F.SnapshotMismatch("snapshot meta has no layer list")
    return layers


class _Builder:
    def __init__(self, hit: Hit, blocks: dict[int, Any] | None = None):
        self.hit = hit
        self.n = int(hit.n)
        self.arrays: list[Any] = []
        self.blocks = blocks or {}

    def _view(self, host: HostTensor) -> Any:
        """`host` as a view of the mlx block it was joined into, or None."""
        import mlx.core as mx

        arr = host.array
        x = self.blocks.get(arr.ctypes.data) if arr.flags.c_contiguous and arr.nbytes else None
        want = mx.bool_ if host.dtype == "bool" else getattr(mx, host.dtype, None)
        if x is None or want is None or arr.nbytes > x.size:
            return None
        return x[: arr.nbytes].view(want).reshape(arr.shape)

    def _mx(self, host: HostTensor) -> Any:
        import mlx.core as mx

        x = self._view(host)
        if x is not None:
            pass
        elif host.dtype == "bfloat16":
            x = mx.array(host.array.view("<u2")).view(mx.bfloat16)
        else:
            x = mx.array(host.array)
            if str(x.dtype).rsplit(".", 1)[-1] != host.dtype:
                raise F.SnapshotMismatch(f"dtype {host.dtype} did not survive the trip into mlx ({x.dtype})")
        self.arrays.append(x)
        return x

    def sliced(self, name: str) -> Any:
        host = self.hit.sliced.get(name)
        if host is None:
            raise F.SnapshotMismatch(f"hit lacks sliced tensor {name}")
        if host.array.ndim != 4 or host.shape[F.TOKEN_AXIS] != self.n:
            raise F.SnapshotMismatch(f"{name} has shape {host.shape}, expected {self.n} tokens on axis 2")
        return self._mx(host)

    def same_heads(self, p: str, names: list[str]) -> None:
        """Keys and values of one layer agree on (batch, kv heads, tokens)."""
        shapes = {tuple(self.hit.sliced[n].shape[:3]) for n in names if n in self.hit.sliced}
        if len(shapes) > 1:
            raise F.SnapshotMismatch(f"layer {p}: keys and values disagree on (batch, heads, tokens): {sorted(shapes)}")

    def floats(self, p: str, hosts: list[HostTensor | None]) -> None:
        """Keys and values are floating point: what every mlx-lm cache but a
        quantized one holds (and the model attends over)."""
        for host in hosts:
            if host is not None and host.dtype not in _FLOATS:
                raise F.SnapshotMismatch(f"layer {p}: keys or values of dtype {host.dtype}")

    def quantized(self, name: str, gs: int, bits: int) -> None:
        """`name`.q/.s/.b as mx.quantize makes them: q uint32 words of `bits`-bit
        codes, and a scale and a bias of one float dtype per `gs` of the values."""
        q, s, b = (self.hit.sliced.get(f"{name}.{part}") for part in "qsb")
        if q is None or s is None or b is None:
            raise F.SnapshotMismatch(f"hit lacks a part of quantized tensor {name}")
        if bits < 1 or gs < 1:
            raise F.SnapshotMismatch(f"{name}: group size {gs}, {bits} bits")
        if (q.dtype != "uint32" or s.dtype != b.dtype or s.dtype not in _FLOATS or s.shape != b.shape
                or len(q.shape) != 4 or q.shape[:3] != s.shape[:3] or q.shape[3] * 32 != s.shape[3] * gs * bits):
            raise F.SnapshotMismatch(f"{name}: parts {q.dtype}{list(q.shape)}, {s.dtype}{list(s.shape)}, "
                                     f"{b.dtype}{list(b.shape)} are not a {bits}-bit quantization in groups of {gs}")

    def boundary_rows(self, p: str, names: list[str]) -> int:
        """The rows (axis 2) the boundary tensors `names` hold, the same in
        each; SnapshotMismatch if they are not such floating-point tensors."""
        hosts = [(self.hit.boundary or {}).get(n) for n in names]
        if any(h is None for h in hosts):
            raise F.SnapshotMismatch(f"hit lacks a boundary tensor of layer {p}")
        self.floats(p, hosts)
        shapes = {tuple(h.shape[:3]) if len(h.shape) == 4 else None for h in hosts}
        if len(shapes) != 1 or None in shapes:
            raise F.SnapshotMismatch(f"layer {p}: boundary keys and values of shapes {[h.shape for h in hosts]}")
        return int(hosts[0].shape[2])

    def boundary(self, name: str) -> Any:
        host = (self.hit.boundary or {}).get(name)
        if host is None:
            raise F.SnapshotMismatch(f"hit lacks boundary tensor {name}")
        return self._mx(host)

    def scalars(self, p: str) -> dict[str, Any]:
        m = (self.hit.boundary_meta or {}).get(p)
        if not isinstance(m, dict):
            raise F.SnapshotMismatch(f"hit lacks boundary meta for layer {p}")
        return m

    def offset_at_boundary(self, p: str, m: dict[str, Any]) -> int:
        offset = int(m["offset"])
        if offset != self.n:
            raise F.SnapshotMismatch(f"layer {p} state is for {offset} tokens, the hit serves {self.n}")
        return offset

    def layer(self, p: str, spec: dict[str, Any]) -> Any:
        from mlx_lm.models import cache as C

        kind = spec.get("k")
        if kind == "kv":
            self.same_heads(p, [f"{p}.k", f"{p}.v"])
            self.floats(p, [self.hit.sliced.get(f"{p}.{kv}") for kv in "kv"])
            c = C.ConcatenateKVCache() if spec.get("c") == "concat" else C.KVCache()
            c.keys, c.values = self.sliced(f"{p}.k"), self.sliced(f"{p}.v")
            c.offset = self.n
            return c
        if kind == "qkv":
            self.same_heads(p, [f"{p}.{kv}.{part}" for kv in "kv" for part in "qsb"])
            gs, bits = int(spec["gs"]), int(spec["bits"])
            for kv in "kv":
                self.quantized(f"{p}.{kv}", gs, bits)
            c = C.QuantizedKVCache(group_size=gs, bits=bits)
            c.keys = tuple(self.sliced(f"{p}.k.{part}") for part in "qsb")
            c.values = tuple(self.sliced(f"{p}.v.{part}") for part in "qsb")
            c.offset = self.n
            return c
        if kind == "rot":
            m = self.scalars(p)
            max_size, keep, offset, idx = int(spec["max"]), int(spec["keep"]), self.offset_at_boundary(p, m), int(m["idx"])
            if max_size < 1 or not 0 <= keep < max_size:
                raise F.SnapshotMismatch(f"layer {p}: a ring buffer of {max_size} rows keeping {keep}")
            # mlx-lm's ring buffer holds at least min(offset, max_size) rows
            # (all it has seen, up to its size; a prefill's concatenation may
            # hold more) and never more than it has seen; `_idx` is within them.
            rows = self.boundary_rows(p, [f"{p}.k", f"{p}.v"])
            if not min(offset, max_size) <= rows <= offset or not 0 <= idx <= rows:
                raise F.SnapshotMismatch(f"layer {p}: a ring buffer of {rows} rows at index {idx} for {offset} "
                                         f"tokens in at most {max_size}")
            c = C.RotatingKVCache(max_size=max_size, keep=keep)
            c.keys, c.values = self.boundary(f"{p}.k"), self.boundary(f"{p}.v")
            c.offset, c._idx = offset, idx
            return c
        if kind == "chunked":
            m = self.scalars(p)
            offset, start = self.offset_at_boundary(p, m), int(m["start"])
            rows = self.boundary_rows(p, [f"{p}.k", f"{p}.v"])
            if not 0 <= start <= offset or rows != offset - start:
                raise F.SnapshotMismatch(f"layer {p}: {rows} rows for the tokens from {start} to {offset}")
            if int(spec["cs"]) < 1:
                raise F.SnapshotMismatch(f"layer {p}: chunks of {spec['cs']} tokens")
            c = C.ChunkedKVCache(int(spec["cs"]))
            c.keys, c.values = self.boundary(f"{p}.k"), self.boundary(f"{p}.v")
            c.offset, c.start_position = offset, start
            return c
        if kind == "arrays":
            m = self.scalars(p)
            nones = set(m.get("none", ()))
            c = C.ArraysCache(int(spec["n"]))
            c.cache = [None if i in nones else self.boundary(f"{p}.a{i}") for i in range(int(spec["n"]))]
            c.left_padding = self.boundary(f"{p}.lp") if m.get("lp") else None
            c.lengths = self.boundary(f"{p}.len") if m.get("len") else None
            return c
        if kind == "list":
            return C.CacheList(*(self.layer(f"{p}.{j}", s) for j, s in enumerate(spec["sub"])))
        raise F.SnapshotMismatch(f"unknown layer kind {kind!r} at layer {p}")
