"""Training data for exit heads: the frozen base's states, computed once per sequence and cached on disk.

A cache is a folder of sequences, each one safetensors file, written atomically (a build that stops resumes where
it stopped: files already there are kept):

    cache.json                       identity (model hash, data, layers, lengths, teacher k) and the sequence list
    train/text_000000.safetensors    teacher-forced chunk of the data (BOS first)
    train/gen_000000.safetensors     one prompt (in the chat template, as `eectl run` feeds it) + the model's own
                                     greedy continuation (`calibrate_measure.generate_continuations`, calibrate's code)
    held/...                         the same from the last records of the data (held out from training)

Per sequence of S tokens: `ids` [S]; `measured` [S] bool (the positions whose next-token prediction is trained and
evaluated: every position after BOS for text, the positions that predict the continuation for generated
sequences; the prompt's positions are there because attention (the block design) needs their keys and values);
`state_{l}` [S, H] float16, the hidden state after layer l for every cached layer; `final` [S, H] float16, the last
layer's state before the final norm (the exact teacher is `adapter.logits(final)`); `teacher_ids` / `teacher_logp`
[S, k], the final layer's top-k tokens and log-probabilities (the top-k loss needs nothing else).

Several designs and losses train from one cache; only the layers they use must be in it.

What this module does not do: train (heads.py), or decide what an exit is.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eectl.errors import DataError, UsageError

CACHE_FORMAT = "eectl-head-states"
CACHE_VERSION = 1
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
    gen_batch: int = 16  # prompts generated together

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
        if self.teacher_k < 2 or self.gen_len < 1 or self.chunk_len < 2 or self.gen_batch < 1:
            raise UsageError("teacher k >= 2, gen len >= 1, chunk len >= 2 and gen batch >= 1 are needed")


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
    states: dict[int, torch.Tensor]  # layer -> [S, H] float16
    final: torch.Tensor  # [S, H] float16
    teacher_ids: torch.Tensor  # [S, k] long
    teacher_logp: torch.Tensor  # [S, k] float32


@dataclass
class StateCache:
    folder: Path
    identity: dict[str, Any]
    entries: list[Entry] = field(default_factory=list)
    build_s: float = 0.0
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

    def describe(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "layers": self.layers,
            "train_tokens": {s: self.tokens("train", s) for s in ("text", "gen")},
            "held_tokens": {s: self.tokens("held", s) for s in ("text", "gen")},
            "teacher_k": self.identity["spec"]["teacher_k"],
            "build_s": round(self.build_s, 1),
        }


def write_sequence(path: Path, seq: Sequence) -> None:
    from safetensors.torch import save_file

    from eectl.files import atomic_write as _atomic_write

    tensors = {
        "ids": seq.ids.to(torch.int64).contiguous(),
        "measured": seq.measured.to(torch.uint8).contiguous(),
        "final": seq.final.to(torch.float16).contiguous(),
        "teacher_ids": seq.teacher_ids.to(torch.int32).contiguous(),
        "teacher_logp": seq.teacher_logp.to(torch.float32).contiguous(),
    }
    for layer, h in seq.states.items():
        tensors[f"state_{layer}"] = h.to(torch.float16).contiguous()
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))


def read_sequence(path: Path) -> Sequence:
    from safetensors.torch import load_file

    t = load_file(str(path))
    states = {int(k.removeprefix("state_")): v for k, v in t.items() if k.startswith("state_")}
    return Sequence(
        ids=t["ids"],
        measured=t["measured"].bool(),
        states=states,
        final=t["final"],
        teacher_ids=t["teacher_ids"].long(),
        teacher_logp=t["teacher_logp"],
    )


@torch.no_grad()
def base_sequence(adapter: Any, ids: list[int], measured: torch.Tensor, layers: list[int], k: int) -> Sequence:
    """The frozen base on one sequence: the cached layers' states, the final state and its top-k."""
    from eectl.head_losses import TeacherTopK

    wanted = set(layers)
    states: dict[int, torch.Tensor] = {}

    def on_layer(i: int, _h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        if i + 1 in wanted:
            states[i + 1] = h_out[0].to(torch.float16)

    x = torch.tensor([ids], dtype=torch.long, device=adapter.device)
    positions = torch.arange(x.shape[1], device=x.device)[None]
    final = adapter.forward_layers(adapter.embed(x), positions, 0, adapter.num_layers, None, on_layer=on_layer)[0]
    teacher = TeacherTopK.of(adapter.logits(final), k)
    return Sequence(
        x[0].cpu(),
        measured,
        {k_: v.cpu() for k_, v in states.items()},
        final.to(torch.float16).cpu(),
        teacher.ids.cpu(),
        teacher.logp.cpu(),
    )


def _identity(loaded: Any, data: Any, spec: CacheSpec) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "base_sha256": loaded.source.sha256,
        "base_name": loaded.source.name,
        "data": data.name,
        "records": len(data.texts),
        # token budgets are left out: a cache can be extended (sequences already there are the same ones)
        "spec": {k: v for k, v in {**asdict(spec), "layers": sorted(spec.layers)}.items() if k not in _BUDGETS},
    }


_BUDGETS = ("text_tokens", "gen_tokens", "eval_gen_tokens")


def build_cache(
    loaded: Any,
    data: Any,
    spec: CacheSpec,
    folder: Path,
    on_tokens: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> StateCache:
    """Compute (or finish computing) the cache for `spec` in `folder`; an existing cache of another identity is
    refused, an identical one is reused. Text chunks first, then generated sequences, per split."""
    from eectl.files import atomic_write as _atomic_write

    say = log or (lambda _m: None)
    adapter = loaded.adapter
    spec.check(adapter.num_layers)
    spec.layers = sorted(spec.layers)
    identity = _identity(loaded, data, spec)
    meta_path = folder / "cache.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text(encoding="utf-8"))
        if old.get("identity") != identity:
            raise UsageError(
                f"{folder} holds a state cache of another model, data or spec",
                hint="pass another --cache folder, or delete this one",
            )
        if old.get("complete") and old.get("budgets") == {k: getattr(spec, k) for k in _BUDGETS}:
            return open_cache(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps({"identity": identity, "complete": False})))
    start = time.perf_counter()
    tok = loaded.tokenizer
    train_data, held_data = _split_data(tok, data, spec)
    entries: list[Entry] = []
    plan = [
        ("train", train_data, spec.text_tokens, spec.gen_tokens),
        ("held", held_data, spec.eval_text_tokens, spec.eval_gen_tokens),
    ]
    for split, part, n_text, n_gen in plan:
        (folder / split).mkdir(exist_ok=True)
        if n_text > 0:
            entries += _cache_text(adapter, tok, folder, split, part, n_text, spec, on_tokens)
        if n_gen > 0:
            done = {e.file for e in entries}
            entries += _cache_generated(adapter, tok, folder, split, part, n_gen, spec, done, on_tokens)
        say(f"state cache: {split} part done ({sum(e.tokens for e in entries if e.split == split)} tokens)")
    build_s = time.perf_counter() - start
    doc = {
        "identity": identity,
        "complete": True,
        "budgets": {k: getattr(spec, k) for k in _BUDGETS},
        "build_s": build_s,
        "entries": [asdict(e) for e in entries],
    }
    _atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8"))
    return StateCache(folder, identity, entries, build_s)


def _split_data(tok: Any, data: Any, spec: CacheSpec) -> tuple[Any, Any]:
    """The training records and the held-out records at the end of the data, with held-out prompts enough for the
    held-out generated part."""
    from eectl.data import TextData, split_records

    train_data, held_data = split_records(tok, data, spec.eval_text_tokens or 1)
    # held-out prompts enough for the held-out generated part (EOS ends some continuations early)
    want = math.ceil(4 * spec.eval_gen_tokens / spec.gen_len)
    if len(held_data.texts) < want < len(data.texts):
        k = len(data.texts) - want
        train_data = TextData(data.name, data.description, data.texts[:k], data.prompts[:k])
        held_data = TextData(data.name, data.description, data.texts[k:], data.prompts[k:])
    return train_data, held_data


def _cache_text(
    adapter: Any,
    tok: Any,
    folder: Path,
    split: str,
    part: Any,
    n_text: int,
    spec: CacheSpec,
    on_tokens: Callable[[int], None] | None,
) -> list[Entry]:
    """The split's teacher-forced chunks, each computed unless its file is already there."""
    from eectl.data import token_chunks

    skip_first = 1 if getattr(tok, "bos_token_id", None) is not None else 0
    body = spec.chunk_len - skip_first  # whole chunks only, so a larger budget extends the same chunks
    n_whole = math.ceil(n_text / body) * body if split == "train" else n_text
    entries = []
    for u, chunk in enumerate(token_chunks(tok, part, n_whole, spec.chunk_len)):
        name = f"{split}/text_{u:06d}.safetensors"
        ids = chunk[0].tolist()
        n = len(ids) - skip_first
        if not (folder / name).is_file():
            measured = torch.zeros(len(ids), dtype=torch.bool)
            measured[skip_first:] = True
            write_sequence(folder / name, base_sequence(adapter, ids, measured, spec.layers, spec.teacher_k))
        entries.append(Entry(split, "text", name, n, len(ids)))
        if on_tokens is not None:
            on_tokens(n)
    return entries


def _cache_generated(
    adapter: Any,
    tok: Any,
    folder: Path,
    split: str,
    part: Any,
    n_gen: int,
    spec: CacheSpec,
    done: set[str],
    on_tokens: Callable[[int], None] | None,
) -> list[Entry]:
    """The split's prompts + greedy continuations until `n_gen` measured tokens; files already there are kept."""
    from eectl.calibrate_measure import generate_continuations, prompt_ids

    max_prompt = max(8, min(adapter.dims.max_positions, 4096) - spec.gen_len - 1)
    prompts = prompt_ids(tok, part.prompts, max_prompt, spec.raw)
    eos = getattr(tok, "eos_token_id", None)
    entries = []
    # Generation is the slow part: continuations are generated batch by batch and cached one by one.
    got = 0
    order = list(range(len(prompts)))
    for b0 in range(0, len(order), spec.gen_batch * 4):
        if got >= n_gen:
            break
        window = order[b0 : b0 + spec.gen_batch * 4]
        todo = [i for i in window if not (folder / f"{split}/gen_{i:06d}.safetensors").is_file()]
        conts = (
            {
                c.unit: c.generated
                for c in generate_continuations(
                    adapter,
                    [prompts[i] for i in todo],
                    len(todo) * spec.gen_len,
                    spec.gen_len,
                    eos,
                    spec.gen_batch,
                )[0]
            }
            if todo
            else {}
        )
        for i in window:
            if got >= n_gen:
                break
            name = f"{split}/gen_{i:06d}.safetensors"
            if i in todo:
                cont = conts.get(todo.index(i), [])
                if not cont:
                    continue
                ids = prompts[i] + cont
                measured = torch.zeros(len(ids), dtype=torch.bool)
                # position j predicts token j + 1: the last prompt position predicts the first continuation
                measured[len(prompts[i]) - 1 : len(ids) - 1] = True
                write_sequence(folder / name, base_sequence(adapter, ids, measured, spec.layers, spec.teacher_k))
            if name in done:
                continue
            seq_measured = int(read_sequence(folder / name).measured.sum())
            entries.append(Entry(split, "gen", name, seq_measured, 0))
            got += seq_measured
            if on_tokens is not None:
                on_tokens(seq_measured)
    if got < n_gen:
        raise DataError(
            f"the {split} part's {len(prompts)} prompts gave only {got} generated tokens, fewer than {n_gen}",
            hint="lower the generated token budget or pass more data",
        )
    return entries


def open_cache(folder: Path) -> StateCache:
    meta_path = folder / "cache.json"
    if not meta_path.is_file():
        raise UsageError(f"no state cache in {folder}", hint="build one with scripts or `eectl train-heads --cache`")
    doc = json.loads(meta_path.read_text(encoding="utf-8"))
    if not doc.get("complete"):
        raise UsageError(f"the state cache in {folder} is incomplete", hint="run the build again to finish it")
    return StateCache(folder, doc["identity"], [Entry(**e) for e in doc["entries"]], float(doc.get("build_s", 0)))
