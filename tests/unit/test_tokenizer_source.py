"""A checkpoint directory with a config.json alone (issue 34 item 4): planned and trained with a tokenizer sized to
the model's vocabulary; data.tokenizer= a directory without a tokenizer is one line naming data.tokenizer."""
import dataclasses
import json

import pytest

from helpers import CPU2, composed
from zerorun.config import DataError, check
from zerorun.config.paths import has_tokenizer
from zerorun.data.prepare import prepare, tokenizer_spec

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 128}


def config_only(tmp_path, config):
    d = tmp_path / config["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("files, expected", [
    ((), False), (("config.json",), False), (("tokenizer_config.json",), False), (("vocab.json",), False),
    (("vocab.json", "merges.txt"), True), (("tokenizer.json",), True), (("tokenizer.model",), True),
    (("vocab.txt",), True),
])
def test_has_tokenizer(tmp_path, files, expected):
    for f in files:
        (tmp_path / f).write_text("{}")
    assert has_tokenizer(str(tmp_path)) is expected


@pytest.mark.heavy
@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_config_json_alone_gets_a_tokenizer_sized_to_the_model(tmp_path, config):
    cfg = composed("+model=hf", f"model.name_or_path={config_only(tmp_path, config)}")
    assert cfg.model.vocab_size == 1000
    assert tokenizer_spec(cfg.data, cfg.model) == "bpe:1000"
    assert check(cfg, CPU2) == []
    prepared = prepare(dataclasses.replace(cfg.data, cache_dir=str(tmp_path / "cache")), cfg.model, cfg.seed)
    assert 256 < prepared.vocab_size <= 1000 and prepared.num_train > 0


def test_a_checkpoints_own_tokenizer_is_used(tmp_path):
    d = config_only(tmp_path, GPT2)
    (d / "tokenizer.json").write_text("{}")
    cfg = composed("+model=hf", f"model.name_or_path={d}")
    assert tokenizer_spec(cfg.data, cfg.model) == str(d)


def test_pretrained_weights_without_their_tokenizer_name_data_tokenizer(tmp_path):
    cfg = composed("+model=hf", f"model.name_or_path={config_only(tmp_path, GPT2)}", "model.pretrained=true")
    with pytest.raises(DataError) as e:
        tokenizer_spec(cfg.data, cfg.model)
    assert e.value.key == "data.tokenizer" and "\n" not in str(e.value)


@pytest.mark.parametrize("contents", [(), ("config.json",)], ids=["empty", "config-only"])
def test_data_tokenizer_without_a_tokenizer_is_one_line(tmp_path, contents):
    for f in contents:
        (tmp_path / f).write_text("{}")
    problems = check(composed(f"data.tokenizer={tmp_path}"), CPU2)
    assert [p.key for p in problems] == ["data.tokenizer"]
    assert "holds no tokenizer" in str(problems[0]) and "data.tokenizer=auto" in str(problems[0])
