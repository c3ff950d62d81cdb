"""train-heads on tiny models: base frozen, KL goes down, saved heads reload exactly, seeded, resumable, CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.heads import HeadsMeta
from eectl.data import TokenStream
from eectl.errors import ArtifactError, UsageError
from eectl.exits.base import ExitHead, signals, topk_candidates
from eectl.exits.designs import DESIGNS, HeadStack, build_heads, load_heads, make_head, save_heads
from eectl.heads.checkpoint import checkpoint_path
from eectl.heads.config import TrainConfig
from eectl.heads.report import iter_report
from eectl.heads.train import train_heads
from eectl.models import load_model
from tests.tiny import GSM8K

runner = CliRunner()
EXITS = [2, 4]


def _config(**kw) -> TrainConfig:
    base = dict(exits=EXITS, steps=30, lr=3e-3, batch_tokens=32, eval_tokens=256, chunk_len=64, save_every=10)
    return TrainConfig(**{**base, **kw})


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def trained(llama, gsm8k, tmp_path_factory):
    """One short training run; the base model's weights are cloned before it for comparison."""
    before = {k: v.clone() for k, v in llama.model.state_dict().items()}
    out = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    result = train_heads(llama, gsm8k, _config(), out)
    return result, before


def test_heads_start_at_the_logit_lens_and_exit_head_wraps_them(llama):
    adapter = llama.adapter
    H = adapter.dims.hidden_size
    h = torch.randn(7, H)
    lens = ExitHead(adapter)
    for design in DESIGNS:
        head = make_head(design, H, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(head(h), h, rtol=0, atol=0)  # zero-initialised last map: identity
        with torch.no_grad():
            for p in head.parameters():
                p.add_(0.05 * torch.randn_like(p))
            wrapped = ExitHead(adapter, head)
            full = wrapped.full(h)
            assert not torch.allclose(full, lens.full(h))
            torch.testing.assert_close(full, lens.full(head(h)))
            # The Top-K local vocabulary works unchanged with a head: local logits are the full ones' rows.
            cand = topk_candidates(full, 16)
            local = wrapped.local(h, cand)
            torch.testing.assert_close(local, full.gather(1, cand), rtol=1e-5, atol=1e-5)
            assert torch.equal(signals(local, cand).token, full.argmax(-1))


def test_head_stack_keys_are_the_file_tensor_names():
    stack = build_heads("mlp", 16, [3, 1], rank=4, seed=0)
    assert stack.exits == [1, 3]
    assert set(stack.state_dict()) == {
        f"exit_{e}.fc{i}.{p}" for e in (1, 3) for i in (1, 2) for p in ("weight", "bias")
    }
    assert set(build_heads("low-rank", 16, [2], rank=4, seed=0).state_dict()) == {"exit_2.down", "exit_2.up"}
    assert set(build_heads("residual-linear", 16, [2], None, 0).state_dict()) == {"exit_2.weight", "exit_2.bias"}


def test_base_is_frozen_and_only_head_parameters_are_new(trained, llama):
    result, before = trained
    after = llama.model.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before), "a base weight changed during training"
    assert not any(p.requires_grad for p in llama.model.parameters())
    # A model with heads = the base + the head stack: loading the base's weights leaves exactly the head params new.
    heads = load_heads(result.out, llama)
    stack = HeadStack({layer: make_head("residual-linear", llama.adapter.dims.hidden_size) for layer in heads.exits})
    with_heads = nn.ModuleDict({"base": type(llama.model)(llama.model.config), "heads": stack})
    missing, unexpected = with_heads.load_state_dict({f"base.{k}": v for k, v in before.items()}, strict=False)
    assert unexpected == []
    # the file's other tensors are the learned signal's probes (not module parameters: eectl.exits.probe)
    stored = _tensors(result.out)
    assert set(missing) == {f"heads.{k}" for k in stored if not k.startswith("probe.")}
    assert {k for k in stored if k.startswith("probe.")} == {
        f"probe.exit_{e}.{p}" for e in heads.exits for p in ("w_state", "w_scalar", "b")
    }  # a few training tokens: logistic probes (an MLP probe adds w_out, b_out)
    heads_only = {k for k in _tensors(result.out) if not k.startswith("probe.")}
    assert heads_only == {f"exit_{e}.{p}" for e in EXITS for p in ("weight", "bias")}


def test_short_training_lowers_held_out_kl(trained):
    result, _ = trained
    pairs = list(iter_report(result.meta))
    assert [b["layer"] for b, _ in pairs] == EXITS
    for before, after in pairs:
        assert before["tokens"] == after["tokens"] == 256
        assert after["kl"] < 0.9 * before["kl"], (before, after)
    rep = result.meta.report
    for name in ("before", "after"):
        assert 2.0 <= rep[name]["oracle_mean_layers"] <= 6.0
        assert 2.0 <= rep[name]["sequential_mean_layers"] <= 6.0


def test_saved_heads_reload_to_identical_outputs(trained, llama, gsm8k, tmp_path):
    result, _ = trained
    meta = result.meta
    on_disk = json.loads(result.sidecar.read_text())
    assert on_disk == meta.model_dump(mode="json")
    for key in ("exits", "design", "rank", "dimensions", "steps", "seed", "report", "data"):
        assert key in on_disk
    assert on_disk["base_model"]["sha256"] == llama.source.sha256
    assert on_disk["dimensions"] == {"num_layers": 6, "hidden_size": 64, "vocab_size": 384}
    assert not any(p.name.endswith(".tmp") for p in result.out.parent.iterdir())

    heads = load_heads(result.out, llama.adapter, sha256=llama.source.sha256)
    assert heads.exits == EXITS and heads.meta.model_dump(mode="json") == on_disk
    h = torch.randn(5, llama.adapter.dims.hidden_size)
    tensors = _tensors(result.out)
    for layer in EXITS:
        head = heads.heads[layer]
        assert not head.training and not any(p.requires_grad for p in head.parameters())
        w, b = tensors[f"exit_{layer}.weight"], tensors[f"exit_{layer}.bias"]
        assert w.abs().sum() > 0  # trained away from the identity
        with torch.no_grad():
            torch.testing.assert_close(
                heads.exit_head(llama.adapter, layer).full(h), ExitHead(llama.adapter).full(h + h @ w.T + b)
            )
    # Saving the reloaded heads again gives the same tensors.
    again = tmp_path / "again.safetensors"
    save_heads(HeadStack(heads.heads), heads.meta, again)
    assert all(torch.equal(v, _tensors(again)[k]) for k, v in tensors.items())


def test_load_heads_refuses_another_model(trained, tiny_dirs, tmp_path):
    result, _ = trained
    qwen2 = load_model(str(tiny_dirs["qwen2"]))  # same dimensions, other weights
    with pytest.raises(ArtifactError, match="another checkpoint"):
        load_heads(result.out, qwen2)
    meta = json.loads(result.sidecar.read_text())
    meta["dimensions"]["hidden_size"] = 32
    bad = tmp_path / "bad.safetensors"
    save_heads(HeadStack(load_heads(result.out, qwen2.adapter).heads), HeadsMeta.model_validate(meta), bad)
    with pytest.raises(ArtifactError, match="hidden_size 32"):
        load_heads(bad, qwen2.adapter)
    with pytest.raises(ArtifactError, match="not found"):
        load_heads(tmp_path / "missing.safetensors", qwen2.adapter)


def test_same_seed_gives_identical_heads(llama, gsm8k, tmp_path):
    cfg = dict(design="mlp", rank=8, steps=8)
    a = train_heads(llama, gsm8k, _config(**cfg), tmp_path / "a.safetensors")
    b = train_heads(llama, gsm8k, _config(**cfg), tmp_path / "b.safetensors")
    c = train_heads(llama, gsm8k, _config(**cfg, seed=1), tmp_path / "c.safetensors")
    ta, tb, tc = _tensors(a.out), _tensors(b.out), _tensors(c.out)
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not all(torch.equal(ta[k], tc[k]) for k in ta)
    assert a.meta.report == b.meta.report


def test_resume_equals_uninterrupted_training(llama, gsm8k, tmp_path):
    cfg = _config(design="low-rank", rank=8, steps=9, save_every=3)
    whole = train_heads(llama, gsm8k, cfg, tmp_path / "whole.safetensors")

    class Stop(Exception):
        pass

    def stop_at_5(step: int, kl: dict[int, float]) -> None:
        if step == 5:
            raise Stop

    part = tmp_path / "part.safetensors"
    with pytest.raises(Stop):
        train_heads(llama, gsm8k, cfg, part, on_step=stop_at_5)
    with safe_open(str(checkpoint_path(part)), framework="pt") as f:  # safetensors + a JSON header, no pickle
        assert json.loads(f.metadata()["state"])["step"] == 3
    assert not part.exists()
    resumed = train_heads(llama, gsm8k, cfg, part, resume=checkpoint_path(part))
    tw, tr = _tensors(whole.out), _tensors(resumed.out)
    assert set(tw) == set(tr) and all(torch.equal(tw[k], tr[k]) for k in tw)
    assert whole.meta.training["final_kl"] == resumed.meta.training["final_kl"]
    # A checkpoint only resumes the run it came from.
    with pytest.raises(UsageError, match="different run"):
        train_heads(llama, gsm8k, _config(design="low-rank", rank=8, steps=9, lr=1e-2), part, checkpoint_path(part))


def test_token_stream_is_a_seeded_function_of_the_step():
    s = TokenStream([5, 3, 7], batch_tokens=4, seed=0)
    epoch = [p for step in range(15 * 2 // 4 + 1) for p in s.batch(step)]
    seen: dict[int, int] = {}
    covered = 0
    for chunk, a, b in epoch:
        assert 0 <= a < b <= s.lengths[chunk]
        covered += b - a
        seen[chunk] = seen.get(chunk, 0) + b - a
    assert covered == 32 and sum(len(p) and p[2] - p[1] for p in s.batch(0)) == 4
    assert all(seen[c] >= s.lengths[c] for c in range(3))  # two epochs cover every chunk
    assert TokenStream([5, 3, 7], 4, 0).batch(6) == s.batch(6)  # stateless in the step
    assert s.epochs(15) == 4.0


@pytest.mark.parametrize(
    "args,code,text",
    [
        (["--exits", "0,2"], 2, "outside the model's layers"),
        (["--exits", "2,6"], 2, "outside the model's layers 1..5"),
        (["--exits", "2,x"], 2, "comma-separated"),
        (["--design", "transformer"], 2, "unknown head design"),
        (["--steps", "0"], 2, "--steps must be positive"),
        (["--rank", "4"], 2, "--rank applies to"),
        (["--data", "/nonexistent.jsonl"], 4, "data not found"),
        (["--device", "tpu"], 2, "--device must be"),
        (["--out", "heads.pt"], 2, ".safetensors"),
        (["--resume", "/nonexistent.ckpt"], 2, "checkpoint not found"),
    ],
)
def test_cli_bad_inputs(tiny_dirs, args, code, text):
    base = ["train-heads", str(tiny_dirs["llama"]), "--data", str(GSM8K), "--exits", "2", "--steps", "2"]
    res = runner.invoke(app, [*base, "--threads", "1", *args])
    assert res.exit_code == code, res.output
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and text in last and res.stdout == ""


def test_both_sources_take_one_config_and_on_the_fly_refuses_what_only_a_cache_trains(llama, gsm8k, tmp_path):
    """One TrainConfig for the model on the fly and for a state cache; a sequence design (block), or a cache folder,
    handed to the on-the-fly trainer is one UsageError line naming the cache's trainer, before any training."""
    import typing

    from eectl.heads.cached import train_cached

    assert typing.get_type_hints(train_cached)["config"] is typing.get_type_hints(train_heads)["config"] is TrainConfig
    assert not _config().from_cache
    for config in (_config(design="block"), _config(cache=tmp_path / "states")):
        assert config.from_cache  # where the stage sends it
        with pytest.raises(UsageError) as err:
            train_heads(llama, gsm8k, config, tmp_path / "h.safetensors")
        message = f"{err.value.message} {err.value.hint or ''}"
        assert "state cache" in message and "train_cached" in message and "\n" not in message
    assert not (tmp_path / "h.safetensors").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cli_cuda_without_gpu_is_one_clear_line(tiny_dirs):
    res = runner.invoke(app, ["train-heads", str(tiny_dirs["llama"]), "--data", str(GSM8K), "--device", "cuda"])
    assert res.exit_code == 2 and "no CUDA GPU" in res.stderr.strip().splitlines()[-1]


def test_cli_trains_and_prints_json(tiny_dirs, tmp_path):
    out = tmp_path / "h.safetensors"
    args = ["train-heads", str(tiny_dirs["llama"]), "--data", str(GSM8K), "--exits", "3", "--steps", "4"]
    res = runner.invoke(app, [*args, "--eval-tokens", "128", "--out", str(out), "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["exits"] == [3] and doc["out"] == str(out) and out.is_file() and checkpoint_path(out).is_file()
    assert doc["training"]["steps"] == 4 and doc["training"]["batch_tokens"] == 32
    with pytest.raises(UsageError, match="outside"):
        _config(exits=[6]).check(6)
