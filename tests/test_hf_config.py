"""Reading HF config.json files (llmdoctor.hf_config), shared by the reference, the mapping check, the
attention check and the faults."""

from __future__ import annotations

import json

import pytest

from llmdoctor.errors import InputError
from llmdoctor.hf_config import read_hf_config, text_config
from llmdoctor.reference.config import from_hf

GEMMA3_TEXT = {"model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 100,
               "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "sliding_window": 16,
               "layer_types": ["sliding_attention", "full_attention"]}


def test_a_multimodal_wrapper_reads_as_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration's config.json keeps the language model under text_config."""
    wrapper = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": GEMMA3_TEXT, "vision_config": {"model_type": "siglip_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    assert text_config(read_hf_config(tmp_path)) == GEMMA3_TEXT
    assert from_hf(tmp_path) == from_hf(GEMMA3_TEXT)
    assert text_config(GEMMA3_TEXT) is GEMMA3_TEXT  # a config with its own layer count is its own text config


@pytest.mark.parametrize("content,message", [(None, "no config.json"), ("{not json", "not a JSON config"),
                                             ("[1, 2]", "not a JSON object")])
def test_bad_configs_are_one_line_input_errors(tmp_path, content, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(InputError, match=message) as e:
        read_hf_config(tmp_path)
    assert "\n" not in str(e.value)
