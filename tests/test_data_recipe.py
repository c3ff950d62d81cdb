from __future__ import annotations

import json
from pathlib import Path

import pytest

from eectl.contracts.recipe import load_recipe
from eectl.data import load_text_data, token_chunks
from eectl.errors import DataError, UsageError
from tests.tiny import GSM8K, tiny_tokenizer

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def test_builtin_default_is_offline_humaneval():
    d = load_text_data(None)
    assert d.name == "humaneval" and len(d.texts) == 164 and d.prompts[0].startswith("from typing")


def test_jsonl_field_detection(tmp_path):
    g = load_text_data(str(GSM8K))
    assert "'question' + 'answer'" in g.description and "####" in g.texts[0]
    f = tmp_path / "pc.jsonl"
    f.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    assert load_text_data(str(f)).texts == ["a\nb"]
    assert load_text_data(str(f), field="prompt").texts == ["a"]
    with pytest.raises(DataError, match="field 'x'"):
        load_text_data(str(f), field="x")


@pytest.mark.parametrize("content", ["", "\n\n", "not json\n", "[1, 2]\n", '{"id": 1}\n'])
def test_bad_jsonl(tmp_path, content):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DataError):
        load_text_data(str(f))


def test_text_file_and_empty(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("one paragraph.\n\nanother one.\n")
    assert load_text_data(str(f)).texts == ["one paragraph.", "another one."]
    f.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_text_data(str(f))


def test_token_chunks_exact_budget():
    tok = tiny_tokenizer()
    d = load_text_data(str(GSM8K))
    chunks = token_chunks(tok, d, 1000, 128)
    assert sum(c.shape[1] - 1 for c in chunks) == 1000
    assert all(c[0, 0].item() == tok.bos_token_id and c.shape[1] <= 128 for c in chunks)
    with pytest.raises(DataError, match="fewer than"):
        token_chunks(tok, load_text_data(str(GSM8K)), 10**9, 128)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_documents_itself(path):
    r = load_recipe(path)
    text = path.read_text()
    assert r.name and text.lstrip().startswith("#") and "eectl " in text.splitlines()[1]
    assert r.exits is None or r.exits == sorted(r.exits)


def test_default_exits():
    from eectl.contracts.layers import default_exits

    assert default_exits(30) == [8, 12, 16, 20, 24]
    assert default_exits(6) == [2, 3, 4, 5] and default_exits(2) == [1]


def test_recipe_errors(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_recipe(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: 1.5\n")
    with pytest.raises(UsageError, match="target"):
        load_recipe(bad)
    bad.write_text("name: x\nunknown_knob: 1\n")
    with pytest.raises(UsageError, match="unknown_knob"):
        load_recipe(bad)
