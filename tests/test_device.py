"""The torch stages on a device (#30 item 3): `--device auto|cpu|cuda` resolves one way for every stage, and the
device path does not bring results to the host per step or per token.

The second part is checked on any device, the CPU included: every way eectl's own code reads a tensor's values on the
host (`.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `.to("cpu")`, `bool()`, `int()`, `float()`, `operator.index()`) is
counted while a stage runs twice, the second time on twice the steps or tokens per batch; on a GPU each is a copy the
host waits for. Per step they would grow with the work; they must grow by at most the few bounded reads the code
documents (generation's EOS check every EOS_CHECK_EVERY steps, training's KL every 16 steps).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from eectl.data import TextData
from eectl.errors import UsageError
from eectl.exits.generation import EOS_CHECK_EVERY, Keep, generate_continuations, prompt_ids
from eectl.models.device import DEVICES, resolve_device
from tests.tiny import TRAIN_TEXT

# the cuda cases are gpu-marked: scripts/gpu_check runs them on a GPU (they read no data file: its stand-in is tiny)
ON = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]
    ),
]
EECTL = str(Path(__file__).resolve().parents[1] / "eectl")
# statistics over results already on the host (the report's thresholds): reads of host data, as many as the data asks
HOST_ONLY = ("thresholds.py",)
_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """Counts, by name and calling function, the host reads of tensors made by eectl's own code (torch's internals, e.g.
    an optimiser's step counter on the host, are not eectl's to avoid)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.on = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in _READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        to = torch.Tensor.to

        def counted_to(t: torch.Tensor, *args, **kwargs):
            target = args[0] if args else kwargs.get("device")
            if target == "cpu" or (isinstance(target, torch.device) and target.type == "cpu" and t.device != target):
                self._count("to(cpu)")
            return to(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", counted_to)

    def _wrap(self, name: str, method):
        def counted(t: torch.Tensor, *args, **kwargs):
            self._count(name)
            return method(t, *args, **kwargs)

        return counted

    def _count(self, name: str) -> None:
        if not self.on:
            return
        caller = sys._getframe(2).f_code
        if caller.co_filename.startswith(EECTL) and Path(caller.co_filename).name not in HOST_ONLY:
            self.counts[f"{name} in {Path(caller.co_filename).name}:{caller.co_name}"] += 1

    def during(self, fn):
        """(fn's result, the reads it made)."""
        self.counts.clear()
        self.on = True
        try:
            result = fn()
        finally:
            self.on = False
        return result, Counter(self.counts)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> HostReads:
    counter = HostReads()
    counter.install(monkeypatch)
    return counter


@pytest.fixture(scope="module")
def text() -> TextData:
    """The tiny tokenizer's own lines as data (32 records, about 1,000 tokens)."""
    return TextData("tiny", "tests.tiny.TRAIN_TEXT", list(TRAIN_TEXT), list(TRAIN_TEXT))


@pytest.fixture
def on_device(llama, request):
    """The tiny Llama moved to the test's device (and back to the CPU after: the fixture is shared)."""
    device = torch.device(request.param)
    llama.model.to(device)
    yield llama
    llama.model.to("cpu")


def _grown(small: Counter[str], large: Counter[str]) -> int:
    return sum(large.values()) - sum(small.values())


def test_device_resolution():
    assert DEVICES == ("auto", "cpu", "cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UsageError, match="--device must be one of auto, cpu, cuda"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="torch sees no CUDA GPU"):
            resolve_device("cuda")


@pytest.mark.parametrize("on_device", ON, indirect=True)
def test_generation_reads_the_host_once_per_batch_and_block_of_steps(on_device, text, reads):
    adapter, tok = on_device.adapter, on_device.tokenizer
    prompts = prompt_ids(tok, text.prompts[:6], 48, raw=True)

    def generate(n: int):
        keep = Keep([2, 4])
        return generate_continuations(adapter, prompts, 6 * n, n, tok.eos_token_id, 3, keep=keep)

    (short, _), small = reads.during(lambda: generate(2 * EOS_CHECK_EVERY))
    (long, _), large = reads.during(lambda: generate(4 * EOS_CHECK_EVERY))
    assert [c.generated[: len(s.generated)] for c, s in zip(long, short, strict=True)] == [c.generated for c in short]
    assert all(v.device.type == adapter.device.type for c in long for v in (c.states or {}).values())
    # 2 * EOS_CHECK_EVERY more steps per batch, 2 batches: at most 2 more EOS checks per batch, not one per step
    assert _grown(small, large) <= 2 * 2, large - small


def _spec(n: int):
    """A tiny state cache's spec with n tokens per sequence: text chunks and continuations alike."""
    from eectl.heads.state_cache import CacheSpec

    return CacheSpec(
        layers=[2, 4],
        text_tokens=4 * (n - 1),
        gen_tokens=6 * n,
        eval_text_tokens=2 * (n - 1),
        eval_gen_tokens=2 * n,
        gen_len=n,
        chunk_len=n,
        teacher_k=4,
        gen_batch=6,
        text_batch=2,
    )


@pytest.mark.parametrize("on_device", ON, indirect=True)
def test_the_state_cache_build_reads_the_host_per_sequence_not_per_token(on_device, text, reads, tmp_path):
    from eectl.heads.state_cache_build import build_cache

    n = 2 * EOS_CHECK_EVERY
    caches, builds = {}, {}
    for k in (n, 2 * n):
        caches[k], builds[k] = reads.during(lambda k=k: build_cache(on_device, text, _spec(k), tmp_path / f"c{k}"))
    assert len(caches[n].entries) == len(caches[2 * n].entries)
    # per sequence written: the same reads; per decode step: at most one EOS check per EOS_CHECK_EVERY steps
    batches = 2  # the training and held-out parts' generation batches
    assert _grown(builds[n], builds[2 * n]) <= batches * n // EOS_CHECK_EVERY, builds[2 * n] - builds[n]


@pytest.mark.parametrize("on_device", ON, indirect=True)
def test_cached_training_reads_the_host_per_block_of_steps(on_device, text, reads, tmp_path):
    from eectl.heads.cached import train_cached
    from eectl.heads.config import TrainConfig
    from eectl.heads.state_cache_build import build_cache

    cache = build_cache(on_device, text, _spec(16), tmp_path / "c")

    def train(steps: int):
        # 2 tokens a step: both runs within the first epoch of the ~150 training tokens (each epoch's order is drawn
        # on the host, from a host generator: no device read)
        config = TrainConfig(exits=[2, 4], steps=steps, batch_tokens=2, save_every=10_000, eval_tokens=32)
        config.device = on_device.adapter.device.type
        return train_cached(on_device, cache, config, tmp_path / f"h{steps}.safetensors")

    done, small = reads.during(lambda: train(32))
    _, large = reads.during(lambda: train(64))
    assert done.meta.training["device"] == on_device.adapter.device.type
    assert len(done.meta.training["final_kl"]) == 2  # the KL history reached the host
    # 32 more steps: two more blocks of the KL history (every 16 steps), not one read per step
    assert _grown(small, large) <= 32 // 16, large - small


@pytest.mark.parametrize("on_device", ON, indirect=True)
def test_profile_brings_its_sums_to_the_host_once(on_device, text, reads):
    from eectl.data import token_chunks
    from eectl.profile.lens import measure_chunks

    chunks = token_chunks(on_device.tokenizer, text, 8 * 63, 64)
    few, small = reads.during(lambda: measure_chunks(on_device.adapter, chunks[:4], "js"))
    many, large = reads.during(lambda: measure_chunks(on_device.adapter, chunks, "js"))
    assert few.agree.device.type == "cpu" and int(many.n.sum()) == 2 * int(few.n.sum())
    assert _grown(small, large) == 0 and sum(large.values()) <= 2, large  # the sums and the oracle, once


@pytest.mark.parametrize("on_device", ON, indirect=True)
def test_calibrate_measures_on_the_device_with_reads_per_batch_only(on_device, text, reads):
    from eectl.calibrate.calibrator import CalibrateOptions, collect

    def measure(n: int):
        # n tokens per chunk and per continuation: the same chunks and prompts, twice the tokens in each
        opts = CalibrateOptions(
            exits=[2, 4], signal="topk-prob", top_k=8, tokens=8 * n, gen_share=0.5, gen_tokens=n, chunk_len=n + 1
        )
        opts.confidence, opts.gen_batch, opts.candidates, opts.shortlist = None, 4, "shortlist", 64
        return collect(on_device, text, opts)

    n = 2 * EOS_CHECK_EVERY
    few, small = reads.during(lambda: measure(n))
    many, large = reads.during(lambda: measure(2 * n))
    assert few.meas.correct.device.type == "cpu" and many.meas.n == 2 * few.meas.n
    # per chunk and per scoring batch the same reads; per decode step at most the EOS check (one batch of 4 prompts)
    assert _grown(small, large) <= n // EOS_CHECK_EVERY, large - small
