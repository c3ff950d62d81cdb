"""Training data for exit heads: the frozen base's states, computed once per sequence and cached on disk.

A cache is a folder of sequences, each one safetensors file, written atomically (a build that stops resumes where
it stopped: files already there are kept):

    cache.json                       identity (model hash, data, layers, lengths, teacher k) and the sequence list
    train/text_000000.safetensors    teacher-forced chunk of the data (BOS first)
    train/gen_000000.safetensors     one prompt (in the chat template, as `eectl run` feeds it) + the model's own
                                     greedy continuation (`calibrate_measure.generate_continuations`, calibrate's code,
                                     which keeps the states it computes: no second base pass)
    held/...                         the same from the last records of the data (held out from training)

Per sequence of S tokens: `ids` [S]; `measured` [S] bool (the positions whose next-token prediction is trained and
evaluated: every position after BOS for text, the positions that predict the continuation for generated sequences; the
prompt's positions are there because attention (the block design) needs their keys and values); `state_{l}` [S, H]
float16, the hidden state after layer l for every cached layer; `final` [S, H] float16, the last layer's state before
the final norm (the exact teacher is `adapter.logits(final)`); `scale_{l}` / `scale_final` [S] float32 where a row
passes float16's range (`encode_half`: such a row is stored divided by a power of two; Gemma's residual stream reaches
~1e5 at BOS, which float16 stored as inf and head training turned into NaN); `teacher_ids` / `teacher_logp` [M, k], the
final layer's top-k tokens and log-probabilities at the M measured positions, in order (the top-k loss needs nothing
else; the LM head is not run where nothing is measured). A generated sequence ends at the last token the generation fed
(prompt + continuation without its last token, which is the last measured position's label).

Where the time goes (default model, 2 threads): generation's decode steps, then the prompts' prefill; the base is
run in batches of `text_batch` chunks for text and not again for generated sequences. `cache.json` keeps the
seconds per phase (`timing`).

Several designs and losses train from one cache; only the layers they use must be in it. A complete cache is
widened in place to more layers (`build_cache` with a spec that differs only by its layers: same model, data,
budgets and every other field): the frozen base runs teacher-forced over each stored sequence's `ids` (up to the
last new layer) and the new `state_{l}` are added to its file, rewritten atomically; the stored tensors are kept as
they are, byte for byte, and nothing is generated again. A generated sequence's new states are therefore
teacher-forced over the generation's own tokens: the same tokens, so the same states as the generation's up to
float rounding (it ran them in a KV-cached, left-padded batch). `cache.json` is rewritten last with the union of the
layers (entries and budgets kept, the widen's seconds a `widen` phase of `timing`); until then it names the old
layers, and a stopped widen resumes: files that already hold every new layer are skipped.

What this module does not do: train (heads/train.py), or decide what an exit is.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eectl.errors import UsageError
from eectl.files import read_utf8
from eectl.parsing import parse_json

CACHE_FORMAT = "eectl-head-states"
CACHE_VERSION = 2  # 2: teacher rows at measured positions only; generated states kept from the generation
SPLITS = ("train", "held")


@dataclass
class CacheSpec:
    """What to cache: token budgets per split and source, the layers, and how sequences are made."""

    layers: list[int]
    text_tokens: int = 100_000  # teacher-forced training tokens
    gen_tokens: int = 25_000  # generated training tokens (the model's own greedy continuations)
    eval_text_tokens: int = 4096  # held-out teacher-forced tokens (the data's last records)
    eval_gen_tokens: int = 1024  # held-out generated tokens (continuations of the held-out records' prompts)
    gen_len: int = 64  # continuation length per prompt (at most; a row ends at EOS)
    chunk_len: int = 256  # teacher-forced chunk length (BOS included)
    teacher_k: int = 32  # the final layer's top-k kept per position
    raw: bool = False  # prompts as is; default: the tokenizer's chat template
    gen_batch: int = 64  # prompts generated together (decode steps are cheaper per row in larger batches)
    text_batch: int = 4  # teacher-forced chunks per base call

    @classmethod
    def for_budget(cls, layers: list[int], tokens: int, gen_share: float, eval_tokens: int) -> CacheSpec:
        """`tokens` training tokens, `gen_share` of them generated; `eval_tokens` held out, in the same shares."""
        n_gen = round(tokens * gen_share)
        return cls(
            layers=layers,
            text_tokens=tokens - n_gen,
            gen_tokens=n_gen,
            eval_text_tokens=eval_tokens,
            eval_gen_tokens=round(eval_tokens * gen_share),
        )

    def check(self, num_layers: int) -> None:
        bad = [x for x in self.layers if not 1 <= x <= num_layers - 1]
        if not self.layers or bad:
            raise UsageError(f"cache layers must be within 1..{num_layers - 1}, got {self.layers}")
        for name in ("text_tokens", "gen_tokens", "eval_text_tokens", "eval_gen_tokens"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name.replace('_', ' ')} must be >= 0, got {getattr(self, name)}")
        if self.text_tokens + self.gen_tokens <= 0 or self.eval_text_tokens + self.eval_gen_tokens <= 0:
            raise UsageError("the cache needs training and held-out tokens")
        if self.teacher_k < 2 or self.gen_len < 1 or self.chunk_len < 2 or min(self.gen_batch, self.text_batch) < 1:
            raise UsageError("teacher k >= 2, gen len >= 1, chunk len >= 2 and gen/text batch >= 1 are needed")


@dataclass
class Entry:
    split: str
    source: str  # "text" or "gen"
    file: str  # relative to the cache folder
    tokens: int  # measured positions
    length: int  # all positions


@dataclass
class Sequence:
    ids: torch.Tensor  # [S] long
    measured: torch.Tensor  # [S] bool
    states: dict[int, torch.Tensor]  # layer -> [S, H] float16 (float32 where a row needed a scale: `decode_half`)
    final: torch.Tensor  # [S, H] float16 (or float32, as the states)
    teacher_ids: torch.Tensor  # [M, k] long, at the measured positions
    teacher_logp: torch.Tensor  # [M, k] float32

    @property
    def first_measured(self) -> int:
        """The measured positions are the sequence's last M (a text chunk's after BOS; a generated sequence's from
        its last prompt position on; `make_sequence` checks it): the first of them, from the shapes alone, so a
        training step slices rows without reading `measured`."""
        return self.ids.numel() - self.teacher_ids.shape[0]


@dataclass
class StateCache:
    folder: Path
    identity: dict[str, Any]
    entries: list[Entry] = field(default_factory=list)
    build_s: float = 0.0
    timing: dict[str, float] = field(default_factory=dict)
    _loaded: OrderedDict[str, Sequence] = field(default_factory=OrderedDict, repr=False)

    @property
    def layers(self) -> list[int]:
        return list(self.identity["spec"]["layers"])

    def split(self, name: str, sources: tuple[str, ...] = ("text", "gen")) -> list[Entry]:
        return [e for e in self.entries if e.split == name and e.source in sources]

    def tokens(self, split: str, source: str | None = None) -> int:
        return sum(e.tokens for e in self.entries if e.split == split and source in (None, e.source))

    def load(self, entry: Entry, keep: int = 4) -> Sequence:
        """One sequence (a small LRU keeps the last few: a training step reads from one or two)."""
        if entry.file not in self._loaded:
            self._loaded[entry.file] = read_sequence(self.folder / entry.file)
            while len(self._loaded) > keep:
                self._loaded.popitem(last=False)
        return self._loaded[entry.file]

    def frequent_tokens(self, entries: list[Entry], n: int) -> torch.Tensor:
        """The n most frequent teacher top-1 tokens over `entries` (sorted ids; ties by id, so deterministic)."""
        from safetensors import safe_open

        counts = torch.zeros(0, dtype=torch.long)
        for entry in entries:
            with safe_open(str(self.folder / entry.file), framework="pt") as f:  # type: ignore[no-untyped-call]
                top1 = f.get_tensor("teacher_ids")[:, 0].long()
            c = torch.bincount(top1)
            if c.numel() > counts.numel():
                c[: counts.numel()] += counts
                counts = c
            else:
                counts[: c.numel()] += c
        order = sorted(range(counts.numel()), key=lambda i: (-int(counts[i]), i))
        return torch.tensor(sorted(order[:n]), dtype=torch.long)

    def describe(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "layers": self.layers,
            "train_tokens": {s: self.tokens("train", s) for s in ("text", "gen")},
            "held_tokens": {s: self.tokens("held", s) for s in ("text", "gen")},
            "teacher_k": self.identity["spec"]["teacher_k"],
            "build_s": round(self.build_s, 1),
            "timing": {k: round(v, 1) for k, v in self.timing.items()},
        }


HALF_MAX = 65504.0  # float16's largest finite value


def encode_half(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """States [S, H] as float16 for the cache file, and the rows' scales [S] float32, or None where every row fits
    float16's range (then the file holds the plain conversion, byte for byte what caches held before scales). A row
    whose largest |value| passes HALF_MAX is divided by the smallest power of two that brings it inside: exact, and
    float16's relative precision for the row's other values. (Some models carry massive activations: Gemma 3's
    residual stream reaches ~1e5 at BOS from its middle layers on.)"""
    h = h.float()
    peak = h.abs().amax(dim=-1)
    over = peak > HALF_MAX  # NaN compares False: a model's non-finite state stays non-finite
    if not bool(over.any()):
        return h.to(torch.float16), None
    scale = torch.ones_like(peak)
    scale[over] = torch.exp2(torch.ceil(torch.log2(peak[over] / HALF_MAX)))
    return (h / scale[:, None]).to(torch.float16), scale


def decode_half(h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What `encode_half` stored: the float16 tensor as it is without scales, float32 with them."""
    return h if scale is None else h.float() * scale[:, None]


def write_sequence(path: Path, seq: Sequence) -> None:
    from safetensors.torch import save_file

    from eectl.files import atomic_write as _atomic_write

    tensors = {
        "ids": seq.ids.to(torch.int64).contiguous(),
        "measured": seq.measured.to(torch.uint8).contiguous(),
        "teacher_ids": seq.teacher_ids.to(torch.int32).contiguous(),
        "teacher_logp": seq.teacher_logp.to(torch.float32).contiguous(),
    }
    for name, h in [("final", seq.final), *((f"state_{layer}", h) for layer, h in seq.states.items())]:
        half, scale = encode_half(h)
        tensors[name] = half.contiguous()
        if scale is not None:
            tensors[f"scale_{name.removeprefix('state_')}"] = scale.contiguous()
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))


def read_sequence(path: Path) -> Sequence:
    from safetensors.torch import load_file

    t = load_file(str(path))
    states = {
        int(k.removeprefix("state_")): decode_half(v, t.get(f"scale_{k.removeprefix('state_')}"))
        for k, v in t.items()
        if k.startswith("state_")
    }
    # a cache written before the scales holds such rows as inf: heads trained on it diverge, and training says so
    # (exits/designs.py `check_trained`); no check here, which would read every sequence's values once more
    return Sequence(
        ids=t["ids"],
        measured=t["measured"].bool(),
        states=states,
        final=decode_half(t["final"], t.get("scale_final")),
        teacher_ids=t["teacher_ids"].long(),
        teacher_logp=t["teacher_logp"],
    )


class Timing(dict[str, float]):
    """Seconds per phase of a build (base pass, generation, teacher top-k, writing)."""

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self[phase] = self.get(phase, 0.0) + now - since
        return now


@torch.no_grad()
def base_states(
    adapter: Any, rows: list[list[int]], layers: list[int], final: bool = True
) -> list[dict[int, torch.Tensor]]:
    """The frozen base on sequences of equal length in one call: per row, the cached layers' states (float32) and
    the final one (key 0, as computed: the teacher is taken from it) [S, H], on the model's device (`make_sequence`
    brings a sequence to the host). Without `final` the base stops after the last of `layers` (no key 0)."""
    wanted = set(layers)
    hi = adapter.num_layers if final else max(layers)
    states: dict[int, torch.Tensor] = {}

    def on_layer(i: int, _h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        if i + 1 in wanted:
            states[i + 1] = h_out.to(torch.float32, copy=True)  # the file's float16 is `write_sequence`'s

    x = torch.tensor(rows, dtype=torch.long, device=adapter.device)
    positions = torch.arange(x.shape[1], device=x.device)[None].expand_as(x)
    out = adapter.forward_layers(adapter.embed(x), positions, 0, hi, None, on_layer=on_layer)
    if final:
        states[0] = out
    return [{k: v[r] for k, v in states.items()} for r in range(len(rows))]


@torch.no_grad()
def make_sequence(
    adapter: Any, ids: list[int], measured: torch.Tensor, states: dict[int, torch.Tensor], k: int
) -> Sequence:
    """A sequence on the host from its states on the model's device (key 0: the final one): the teacher's top-k at
    the measured positions (`measured` [S] bool, on the host), computed there; one copy per tensor it keeps."""
    from eectl.heads.losses import TeacherTopK

    final = states[0]
    idx = torch.nonzero(measured).flatten()
    if idx.numel() and int(idx[0]) != len(ids) - idx.numel():  # Sequence.first_measured relies on it
        raise ValueError("internal: a sequence's measured positions must be its last ones")
    idx = idx.to(final.device)
    teacher = TeacherTopK.of(adapter.logits(final[idx].float()), k)
    layers = {layer: h.to("cpu") for layer, h in states.items() if layer != 0}
    return Sequence(
        torch.tensor(ids, dtype=torch.long),
        measured,
        layers,
        final.to("cpu"),
        teacher.ids.cpu(),
        teacher.logp.cpu(),
    )


def open_cache(folder: Path) -> StateCache:
    meta_path = folder / "cache.json"
    if not meta_path.is_file():
        raise UsageError(f"no state cache in {folder}", hint="build one with scripts or `eectl train-heads --cache`")
    doc = parse_json(read_utf8(meta_path, UsageError), f"the state cache's {meta_path} is not valid JSON", UsageError)
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise UsageError(f"{meta_path} is not an eectl state cache", hint="build it again with train-heads --cache")
    if not doc.get("complete"):
        raise UsageError(f"the state cache in {folder} is incomplete", hint="run the build again to finish it")
    entries = [Entry(**e) for e in doc["entries"]]
    return StateCache(folder, doc["identity"], entries, float(doc.get("build_s", 0)), doc.get("timing", {}))
