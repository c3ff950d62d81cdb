from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from eectl.contracts.calibration import Calibration, DataInfo, ExitResult, ModelInfo, OverallStats, SplitStats
from eectl.contracts.heads import HeadCost, HeadDims, HeadsMeta
from eectl.data import load_text_data
from eectl.exits.designs import head_cost, head_width
from eectl.exits.signals import SIGNALS
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.runtime.ort import init_ort
from tests.tiny import GSM8K, TINY_CONFIGS, save_tiny

torch.set_num_threads(1)
init_ort(1)  # one global ONNX Runtime pool for the whole test process
os.environ.setdefault("EECTL_QUIET", "1")
# fp32 graphs on a GPU compute in fp32 here: ONNX Runtime's CUDA EP (use_tf32 on by default) and torch would otherwise
# round float32 matmuls' inputs to TF32, and the gpu-marked tests compare fp32 runs with the torch simulation
# (tests/simulation.py). cuBLAS and cuDNN read this before their first handle, so it is set before any session.
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")


@pytest.fixture(autouse=True)
def _no_bench_settle(monkeypatch) -> None:
    """bench pauses before each timed configuration so spinning threads go idle; tests time nothing."""
    monkeypatch.setattr("eectl.evaluate.timing.SETTLE_S", 0.0)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every family's tiny model saved as a Hugging Face folder (save_pretrained layout)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {t: save_tiny(t, root / t) for t in TINY_CONFIGS}


@pytest.fixture(params=sorted(TINY_CONFIGS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    """The tiny Llama, loaded once per test module."""
    return load_model(str(tiny_dirs["llama"]))


@pytest.fixture(scope="module")
def gsm8k():
    return load_text_data(str(GSM8K))


EXPORT_EXITS = [2, 4]
EXPORT_TOP_K = 8


@pytest.fixture(scope="session")
def exported(tiny_dirs, tmp_path_factory):
    """family -> (loaded model, artifact folder): every family exported once, exits 2 and 4, K = 8."""
    root = tmp_path_factory.mktemp("artifacts")
    out = {}
    for fam, folder in tiny_dirs.items():
        loaded = load_model(str(folder))
        export_artifact(loaded, root / fam, ExportOptions(exits=EXPORT_EXITS, top_k=EXPORT_TOP_K))
        out[fam] = (loaded, root / fam)
    return out


def make_calibration(loaded, thresholds: dict[int, dict[str, float]], signal: str = "topk-prob", top_k: int = 8):
    """A valid Calibration for `loaded` with the given per-exit thresholds (inf: never exits) and empty statistics."""
    a = loaded.adapter
    src = loaded.source.to_dict()
    split = SplitStats(reached=0, exited=0, coverage=0.0, precision=None)
    overall = OverallStats(
        tokens=0, exited=0, exit_rate=0.0, precision=None, agreement=1.0, mean_layers=6.0, speedup_bound=1.0
    )
    layers = sorted(thresholds)
    local = SIGNALS[signal].needs_candidates
    return Calibration(
        model=ModelInfo(
            name=str(src["name"]),
            kind=str(src["kind"]),
            spec=str(src["spec"]),
            path=None,
            sha256=loaded.source.sha256,
            family=a.family,
            num_layers=a.num_layers,
        ),
        data=DataInfo(
            name="test",
            description="test",
            records=0,
            tokens=0,
            teacher_forced_tokens=0,
            generated_tokens=0,
            prompts_used=0,
            chat_template=False,
            gen_tokens_per_prompt=0,
            chunk_len=0,
            holdout=0.0,
            calibration_tokens=0,
            heldout_tokens=0,
        ),
        signal=signal,
        criteria=list(SIGNALS[signal].criteria),
        top_k=top_k if local else None,
        candidates_layer=layers[0] if local else None,
        target=0.9,
        confidence=None,
        exits=[ExitResult(layer=e, head=False, thresholds=thresholds[e], calibration=split) for e in layers],
        calibration=overall,
        heldout=None,
    )


def make_heads_meta(
    loaded, exits: list[int], design: str = "residual-linear", rank: int | None = None, probe: dict | None = None
) -> HeadsMeta:
    """Valid HeadsMeta for heads of `design` at `exits` on `loaded` (the design's real cost), with empty training
    records and the given probe metadata."""
    d = loaded.adapter.dims
    return HeadsMeta(
        exits=exits,
        design=design,
        rank=rank,
        width=head_width(design, rank, d.hidden_size),
        head_cost=HeadCost(**head_cost(design, rank, d.hidden_size)),
        dimensions=HeadDims(num_layers=d.num_layers, hidden_size=d.hidden_size, vocab_size=d.vocab_size),
        base_model=loaded.source.to_dict(),
        data={},
        training={},
        steps=0,
        seed=0,
        report={},
        probe=probe,
    )
