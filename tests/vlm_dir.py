"""An offline mlx-vlm model directory: a tiny random-weight Qwen2-VL.

`build_vlm_dir(path)` writes what `mlx_vlm.load` (and so vllm-mlx's MLLM
route) needs, with nothing downloaded: config.json (qwen2_vl, a 2-layer
text model and a 1-block vision tower), model.safetensors (seeded weights;
both by tests/model_dir.py's `save_model`), its WordLevel tokenizer
(`write_tokenizer`) over tests/model_dir.py's words plus Qwen2-VL's
vision specials, a chat template that puts `<|vision_start|><|image_pad|>
<|vision_end|>` where an image goes, and a Qwen2VLImageProcessor config with
small pixel bounds (an image becomes a handful of tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

from model_dir import WORDS, save_model, write_tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB = SPECIALS + WORDS

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_vlm_dir(path: str | Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a tiny random-weight Qwen2-VL model directory at `path`; returns it."""
    import mlx.core as mx
    from mlx_vlm.models import qwen2_vl

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen2_vl",
        "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
        "vocab_size": len(VOCAB), "max_position_embeddings": 32768, "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},  # sums to head_dim / 2
        "tie_word_embeddings": False,
        "image_token_id": VOCAB.index("<|image_pad|>"),
        "video_token_id": VOCAB.index("<|video_pad|>"),
        "vision_start_token_id": VOCAB.index("<|vision_start|>"),
        "bos_token_id": VOCAB.index("<s>"), "eos_token_id": VOCAB.index("</s>"),
        "vision_config": {
            "model_type": "qwen2_vl", "depth": 1, "embed_dim": 64, "hidden_size": 128, "num_heads": 2,
            "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "in_channels": 3, "mlp_ratio": 2,
        },
    }
    mx.random.seed(seed)
    cfg = qwen2_vl.ModelConfig.from_dict(json.loads(json.dumps(config)))
    cfg.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    cfg.text_config = qwen2_vl.TextConfig.from_dict(config)
    save_model(path, qwen2_vl.Model(cfg), config, dtype)
    write_tokenizer(path, SPECIALS, CHAT_TEMPLATE)
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    }, indent=2))
    return path


if __name__ == "__main__":  # python tests/vlm_dir.py OUT_DIR
    import sys

    print(build_vlm_dir(sys.argv[1]))
