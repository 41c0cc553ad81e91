"""Media requests on vllm-mlx's MLLM route: prefix reuse keyed by the media's content.

Theory of operation
-------------------
vllm-mlx keeps every request with media out of its prefix cache
(`is_text_only_prefix_cache_request`): its RAM keys are token tuples, and the
image placeholder tokens are the same for every image. The adapter lets such
a request in only when it can key its media:

1. `MLLMBatchGenerator._preprocess_request` is wrapped: once the request's
   pixels are ready, `describe` finds the runs of image/video placeholder
   tokens in its `input_ids` and one digest over everything that decides
   their KV -- every pixel array and grid of the request, other media
   kwargs, and the vision tower's weights (`kvd_client.media_digest`). One
   digest for all of a request's media is conservative: two requests share a
   prefix through an image only if all their media are equal, never wrongly.
2. The predicate is wrapped: it also admits a described media request, and
   remembers it (per thread) as the request the next cache call is about --
   vllm-mlx asks the predicate right before each `fetch` / `store` of that
   request, on the same thread.
3. The prefix cache (`_prefix.KvdPrefixCache`) turns the tokens of such a call
   into a *salted key*: each placeholder position becomes a negative integer
   that encodes the digest, the placeholder id and the position within its
   run (`salt`). Negative ids never occur in real prompts, so vllm-mlx's own
   RAM matching (exact, prefix, LCP on tuples) becomes media-aware as it is.
   kvd gets the real tokens and media spans back from any key (`unsalt`), so
   what goes to the daemon is the protocol's media-aware key (PROTOCOL.md 4.1).
4. A hit for a media request is used only if it covers every media position:
   vllm-mlx resumes a hit by running the language model alone on the rest
   (with the request's own M-RoPE positions), which cannot encode an image.

Requests whose media leaves no placeholder run in `input_ids` (models that
expand a single token inside the model), or audio, stay out of the cache.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from kvd.protocol.keys import MediaSpan

log = logging.getLogger("kvd_client.vllm_mlx")

_current = threading.local()
# id(model) -> (a weak reference to the model, its vision digest). Weak, so a
# digest never keeps a model alive; checked against the reference, so a new
# model that gets a dead one's id never gets the dead one's digest.
_vision_ids: dict[int, tuple[weakref.ref, str]] = {}


@dataclass(frozen=True)
class RequestMedia:
    """A media request's real token ids, its salted key and where its media ends."""

    tokens: tuple[int, ...]
    salted: tuple[int, ...]
    end: int  # one past the last media position


def salt_value(digest: bytes, placeholder: int, j: int) -> int:
    """The key value of the j-th position of a placeholder run (always negative)."""
    return -(1 + (int.from_bytes(digest, "big") << 64) + (placeholder << 32) + j)


def salt(tokens: Sequence[int], runs: Sequence[tuple[int, int]], digest: bytes) -> tuple[int, ...]:
    """`tokens` with every position of each run [start, end) replaced by its salt value."""
    out = list(tokens)
    for start, end in runs:
        for j, p in enumerate(range(start, end)):
            out[p] = salt_value(digest, int(tokens[p]), j)
    return tuple(out)


def unsalt(key: Sequence[int]) -> tuple[list[int], list[MediaSpan]]:
    """(real token ids, media spans) of a key; spans empty for a text key."""
    if not key or min(key) >= 0:  # a text key: no per-token Python loop
        return list(key), []
    tokens: list[int] = []
    spans: list[MediaSpan] = []
    last_p, last_j, last_digest = -2, -2, b""
    for p, v in enumerate(key):
        if v >= 0:
            tokens.append(int(v))
            continue
        x = -v - 1
        j, placeholder, digest = x & 0xFFFFFFFF, (x >> 32) & 0xFFFFFFFF, (x >> 64).to_bytes(32, "big")
        tokens.append(placeholder)
        if p == last_p + 1 and j == last_j + 1 and digest == last_digest:
            spans[-1] = MediaSpan(spans[-1].start, p + 1, digest)  # the run goes on
        else:
            spans.append(MediaSpan(p, p + 1, digest))
        last_p, last_j, last_digest = p, j, digest
    return tokens, spans


def placeholder_ids(model: Any) -> set[int]:
    """The image/video placeholder token ids of an mlx-vlm model (from its config)."""
    cfg = getattr(model, "config", None)
    ids = set()
    for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v >= 0:
            ids.add(v)
    return ids


def vision_id(model: Any) -> str:
    """A digest of every weight of `model` outside its language model (once per model)."""
    key = id(model)
    known = _vision_ids.get(key)
    if known is not None and known[0]() is model:
        return known[1]
    from mlx.utils import tree_flatten

    from kvd_client.mlx_lm import weights_digest

    params = [(k, v) for k, v in tree_flatten(model.parameters()) if not k.startswith("language_model.")]
    digest = weights_digest(params)

    def forget(ref: weakref.ref) -> None:
        if _vision_ids.get(key, (None,))[0] is ref:
            del _vision_ids[key]

    _vision_ids[key] = (weakref.ref(model, forget), digest)
    return digest


def describe(model: Any, request: Any) -> RequestMedia | None:
    """The media key of a preprocessed MLLM request, or None if it cannot be keyed."""
    from kvd_client._media import digest as media_digest

    if getattr(request, "audio", None) or getattr(request, "input_ids", None) is None:
        return None
    pixels = getattr(request, "pixel_values", None)
    if pixels is None:
        return None
    placeholders = placeholder_ids(model)
    tokens = tuple(int(t) for t in request.input_ids.reshape(-1).tolist())
    runs, start = [], None
    for p, t in enumerate(tokens + (-1,)):
        if t in placeholders and start is None:
            start = p
        elif t not in placeholders and start is not None:
            runs.append((start, p))
            start = None
    if not runs:
        return None
    parts: list[Any] = [vision_id(model)]
    extras = dict(getattr(request, "extra_kwargs", None) or {})
    for name, value in [("pixel_values", pixels), ("image_grid_thw", getattr(request, "image_grid_thw", None)),
                        *sorted(extras.items())]:
        if value is None:
            continue
        parts.append(name)
        parts.append(_host(value) if hasattr(value, "dtype") else repr(value))
    digest = media_digest(*parts)
    return RequestMedia(tokens, salt(tokens, runs, digest), runs[-1][1])


def _host(x: Any) -> Any:
    """An mx.array as numpy (bfloat16 as its uint16 bits), on this thread."""
    import numpy as np

    if type(x).__module__.startswith("mlx"):
        import mlx.core as mx

        if x.dtype == mx.bfloat16:
            x = x.view(mx.uint16)
        return np.array(x)
    return np.asarray(x)


# -- the current request (set by the wrapped predicate, read by the cache) -------------
def note(request: Any) -> None:
    _current.media = getattr(request, "_kvd_media", None)


def for_tokens(tokens: Sequence[int]) -> RequestMedia | None:
    """The current request's media key if `tokens` are (a prefix of) its tokens."""
    media = getattr(_current, "media", None)
    if media is None or len(tokens) > len(media.tokens):
        return None
    if tuple(int(t) for t in tokens) != media.tokens[: len(tokens)]:
        return None
    return media


# -- installing on vllm_mlx.mllm_batch_generator ---------------------------------------
def install(module: Any) -> bool:
    """Wrap the MLLM generator's preprocessing and prefix-cache predicate in `module`."""
    gen = getattr(module, "MLLMBatchGenerator", None)
    predicate = getattr(module, "is_text_only_prefix_cache_request", None)
    preprocess = getattr(gen, "_preprocess_request", None)
    if gen is None or predicate is None or preprocess is None:
        log.info("kvd: vllm-mlx's MLLM generator lacks what media keys need; media requests stay uncached")
        return False
    if getattr(predicate, "_kvd_original", None) is not None:
        return True

    def is_cacheable(request: Any) -> bool:
        note(request)
        return bool(predicate(request)) or getattr(request, "_kvd_media", None) is not None

    def _preprocess_request(self: Any, request: Any) -> Any:
        result = preprocess(self, request)
        if getattr(request, "_kvd_media", None) is None and not getattr(request, "is_text_only", True):
            try:
                request._kvd_media = describe(self.model, request)
            except Exception:
                log.exception("kvd: cannot key this request's media; it stays uncached")
                request._kvd_media = None
        return result

    is_cacheable._kvd_original = predicate
    _preprocess_request._kvd_original = preprocess
    module.is_text_only_prefix_cache_request = is_cacheable
    gen._preprocess_request = _preprocess_request
    return True


def uninstall(module: Any) -> None:
    predicate = getattr(module, "is_text_only_prefix_cache_request", None)
    if getattr(predicate, "_kvd_original", None) is not None:
        module.is_text_only_prefix_cache_request = predicate._kvd_original
    gen = getattr(module, "MLLMBatchGenerator", None)
    preprocess = getattr(gen, "_preprocess_request", None) if gen is not None else None
    if getattr(preprocess, "_kvd_original", None) is not None:
        gen._preprocess_request = preprocess._kvd_original
