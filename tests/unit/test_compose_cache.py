"""zerorun-estimate's composed configs on disk (config/compose_cache.py): a hit is the config Hydra composes, and
anything it was composed from changing (a checkpoint's config.json, the overrides) composes afresh."""
import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from zerorun.config import compose, load
from zerorun.config import compose_cache as C


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERORUN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "compose"


def no_hydra(monkeypatch):
    def refuse(overrides, files_read):
        raise AssertionError(f"composed again: {overrides}")
    monkeypatch.setattr(load, "_compose", refuse)


@pytest.mark.heavy
def test_a_hit_is_what_hydra_composes_and_skips_it(cache, monkeypatch):
    overrides = ["+model=gpt2", "zero=stage2", "offload=cpu", "trainer.micro_batch_size=3"]
    fresh = compose(overrides)
    assert compose(overrides, cached=True) == fresh  # the miss composes and stores
    assert len(list(cache.glob("*.pkl"))) == 1
    no_hydra(monkeypatch)
    assert compose(overrides, cached=True) == fresh
    with pytest.raises(AssertionError, match="composed again"):  # other overrides are another entry
        compose(overrides + ["trainer.micro_batch_size=4"], cached=True)


@pytest.mark.heavy
def test_a_changed_config_json_composes_afresh(cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    d = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 64}
    (ckpt / "config.json").write_text(json.dumps(d))
    overrides = ["+model=hf", f"model.name_or_path={ckpt}"]
    assert compose(overrides, cached=True).model.num_layers == 2
    assert compose(overrides, cached=True).model.num_layers == 2
    st_ = os.stat(ckpt / "config.json")
    (ckpt / "config.json").write_text(json.dumps({**d, "num_hidden_layers": 3}))
    os.utime(ckpt / "config.json", ns=(st_.st_atime_ns, st_.st_mtime_ns + 1))  # a coarse clock still moves
    assert compose(overrides, cached=True).model.num_layers == 3


@pytest.mark.heavy
def test_interpolations_and_unreadable_entries_are_composed(cache, monkeypatch):
    monkeypatch.setenv("ZR_TEST_NAME", "from-env")
    assert compose(["+model=tiny-gpt2", "name=${oc.env:ZR_TEST_NAME}"], cached=True).name == "from-env"
    assert not cache.exists() or not list(cache.glob("*.pkl"))  # the environment is not in the key: not kept
    overrides = ["+model=tiny-gpt2"]
    compose(overrides, cached=True)
    (entry,) = cache.glob("*.pkl")
    entry.write_bytes(b"\x80truncated")
    assert compose(overrides, cached=True) == compose(overrides)


def test_the_key_covers_the_packaged_conf():
    import importlib.resources

    conf = os.path.realpath(str(importlib.resources.files("zerorun.conf")))
    assert conf in [os.path.realpath(r) for r in C.source_roots()]
    assert not C.cacheable(["+model=gpt2", "hydra.searchpath=[file:///elsewhere]"])


@pytest.mark.heavy
def test_a_read_only_cache_still_composes(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ZERORUN_CACHE", str(blocker))
    assert compose(["+model=tiny-bert"], cached=True) == compose(["+model=tiny-bert"])


@pytest.mark.heavy
@settings(max_examples=8, deadline=None, derandomize=True)
@given(model=st.sampled_from(["tiny-gpt2", "tiny-llama", "qwen3-8b", "gemma-2-9b"]), stage=st.integers(0, 3),
       offload=st.sampled_from(["none", "cpu"]), precision=st.sampled_from(["fp32", "bf16", "fp16"]),
       adapter=st.sampled_from(["none", "lora"]))
def test_cached_equals_composed(tmp_path_factory, model, stage, offload, precision, adapter):
    overrides = [f"+model={model}", f"zero=stage{stage}", f"offload={offload}", f"precision={precision}",
                 f"adapter={adapter}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZERORUN_CACHE", str(tmp_path_factory.mktemp("cache")))
        fresh = compose(overrides)
        assert compose(overrides, cached=True) == fresh and C.load(C.key(overrides)) == fresh
