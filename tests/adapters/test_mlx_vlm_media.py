"""Media-aware keys used from mlx-vlm directly (the README example), on a tiny Qwen2-VL.

A real mlx-vlm model and processor: the prompt cache of "system + image +
question" is stored with the image's span and digest; the same image finds
all of it, bit for bit; another image finds only the text before the image.
"""

from __future__ import annotations

import numpy as np
import pytest

from model_dir import words

mlx_vlm = pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (./dev installs it)")
pytest.importorskip("PIL", reason="pillow is not installed (./dev installs it)")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from vlm_dir import build_vlm_dir

    return mlx_vlm.load(str(build_vlm_dir(tmp_path_factory.mktemp("qwen2vl"))))


def prefill(model, processor, image_seed: int):
    """(token ids, the image's MediaSpan, the language model's prompt cache) for one request."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from PIL import Image

    from kvd_client import MediaSpan, media_digest
    from kvd_client.mlx_lm._namespace import weights_digest
    from mlx.utils import tree_flatten

    image = Image.fromarray(np.random.default_rng(image_seed).integers(0, 255, (80, 80, 3), dtype=np.uint8))
    prompt = f"<|system|> {words(300, seed=41)} <|end|> <|user|> <|vision_start|><|image_pad|><|vision_end|> kan lor <|end|> <|assistant|>"
    inputs = processor(text=[prompt], images=[image], return_tensors="np")
    ids = inputs["input_ids"][0].tolist()
    pos = [i for i, t in enumerate(ids) if t == model.config.image_token_id]
    vision_id = weights_digest([(k, v) for k, v in tree_flatten(model.parameters()) if not k.startswith("language_model.")])
    span = MediaSpan(pos[0], pos[-1] + 1, media_digest(inputs["pixel_values"], inputs["image_grid_thw"], vision_id))
    cache = make_prompt_cache(model.language_model)
    model(mx.array(inputs["input_ids"]), cache=cache, pixel_values=mx.array(inputs["pixel_values"]),
          image_grid_thw=mx.array(inputs["image_grid_thw"]))
    mx.eval([c.keys for c in cache])
    return ids, span, cache


def test_the_same_image_finds_the_cache_and_another_image_only_the_text_before_it(vlm, kvd_daemon):
    import mlx.core as mx

    from kvd_client.mlx_lm import namespace_for

    model, processor = vlm
    ns = namespace_for(model.language_model)
    ids, span, cache = prefill(model, processor, image_seed=1)
    assert span.start > 256  # the image sits after the first kvd chunk
    with kvd_daemon.client(ns, strict=True) as kv:
        assert kv.store(ids, cache, media=[span], wait=True)

    with kvd_daemon.client(ns, strict=True) as kv:
        again, n = kv.fetch(ids, media=[span])
        assert n == len(ids) - 1
        for got, ref in zip(again, cache, strict=True):
            assert mx.array_equal(got.keys[..., :n, :], ref.keys[..., :n, :]).item()
            assert mx.array_equal(got.values[..., :n, :], ref.values[..., :n, :]).item()

        other_ids, other_span, _ = prefill(model, processor, image_seed=2)
        assert other_ids == ids and other_span.digest != span.digest  # same tokens, another image
        assert kv.lookup(ids, media=[other_span]) == 256  # the chunk before the image, no further
        assert kv.lookup(ids) == 256  # the placeholders alone are not the image either
