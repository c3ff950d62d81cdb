"""The one layer-range forward equals the transformers model's own logits, whole, in pieces and with a cache."""

from __future__ import annotations

import pytest
import torch

from eectl.errors import ModelLoadError
from eectl.models import ADAPTERS, KVCache, adapter_for, load_model
from tests.tiny import TINY_CONFIGS, tiny_model

ATOL = 1e-4  # fp32, different kernels' summation order


def test_every_registered_family_has_a_tiny_model():
    assert set(ADAPTERS) == set(TINY_CONFIGS), "each registered model_type needs a tiny test model in tests/tiny.py"


def _ids(seed: int, n: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


def test_full_forward_matches_transformers(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    ids = _ids(1, 40, model.config.vocab_size)  # longer than the tiny sliding windows
    with torch.no_grad():
        ref = model(ids).logits
        ours = adapter.forward_tokens(ids)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)


def test_pieces_and_cache_match_transformers(family):
    """Prefill 20, a 7-token chunk, then one-token decodes, each through layers in 3 pieces with a cache."""
    model = tiny_model(family)
    adapter = adapter_for(model)
    ids = _ids(2, 35, model.config.vocab_size)
    L = adapter.num_layers
    cuts = [0, 2, 5, L]
    cache = KVCache()
    outs = []
    with torch.no_grad():
        ref = model(ids).logits
        for lo, hi in [(0, 20), (20, 27)] + [(i, i + 1) for i in range(27, 35)]:
            pos = torch.arange(lo, hi)[None]
            h = adapter.embed(ids[:, lo:hi])
            for a, b in zip(cuts, cuts[1:], strict=False):
                h = adapter.forward_layers(h, pos, a, b, cache)
            outs.append(adapter.logits(h))
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, atol=ATOL, rtol=1e-4)
    assert all(cache.length(i) == 35 for i in range(L))


def test_batch_with_left_padding_matches_rows_alone(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    a = _ids(3, 12, model.config.vocab_size)
    b = _ids(4, 9, model.config.vocab_size)
    pad = torch.zeros(1, 3, dtype=torch.long)
    batch = torch.cat([a, torch.cat([pad, b], dim=1)])
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :3] = False
    positions = torch.stack([torch.arange(12), torch.cat([torch.zeros(3, dtype=torch.long), torch.arange(9)])])
    with torch.no_grad():
        h = adapter.forward_layers(adapter.embed(batch), positions, 0, adapter.num_layers, KVCache(), keep)
        both = adapter.logits(h)
        torch.testing.assert_close(both[0], adapter.forward_tokens(a)[0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(both[1, 3:], adapter.forward_tokens(b)[0], atol=ATOL, rtol=1e-4)


def test_crop_rolls_back(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    ids = _ids(5, 16, model.config.vocab_size)
    with torch.no_grad():
        cache = KVCache()
        adapter.forward_tokens(ids[:, :10], cache)
        adapter.forward_tokens(ids[:, 10:14], cache)
        cache.crop(10)
        again = adapter.forward_tokens(ids[:, 10:16], cache)
        torch.testing.assert_close(again, model(ids).logits[:, 10:16], atol=ATOL, rtol=1e-4)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert "gpt2" in err.value.message and "llama" in (err.value.hint or "")


def test_load_hf_folder(tiny_dirs, family):
    loaded = load_model(str(tiny_dirs[family]))
    assert loaded.adapter.family == family
    assert loaded.source.kind == "hf-folder" and len(loaded.source.sha256) == 64
    assert loaded.tokenizer("12 clips")["input_ids"]


def test_threshold_for_precision_is_minimal():
    from eectl.exits.thresholds import threshold_for_precision

    conf = torch.tensor([0.9, 0.8, 0.8, 0.7, 0.6, 0.5])
    good = torch.tensor([True, True, False, True, True, False])
    c = threshold_for_precision(conf, good, 0.75)  # prefixes: 1, 1, 2/3 (tie kept), 3/4, 4/5, 4/6
    assert (
        c.threshold == pytest.approx(0.6) and c.coverage == pytest.approx(5 / 6) and c.precision == pytest.approx(0.8)
    )
    assert threshold_for_precision(conf, good, 1.0).threshold == pytest.approx(0.9)
    none = threshold_for_precision(conf, torch.zeros(6, dtype=torch.bool), 0.5)
    assert none.threshold == float("inf") and none.coverage == 0.0
