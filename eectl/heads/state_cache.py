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
evaluated: every position after BOS for text, the positions that predict the continuation for generated
sequences; the prompt's positions are there because attention (the block design) needs their keys and values);
`state_{l}` [S, H] float16, the hidden state after layer l for every cached layer; `final` [S, H] float16, the last
layer's state before the final norm (the exact teacher is `adapter.logits(final)`); `teacher_ids` / `teacher_logp`
[M, k], the final layer's top-k tokens and log-probabilities at the M measured positions, in order (the top-k loss
needs nothing else; the LM head is not run where nothing is measured). A generated sequence ends at the last token
the generation fed (prompt + continuation without its last token, which is the last measured position's label).

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
    states: dict[int, torch.Tensor]  # layer -> [S, H] float16
    final: torch.Tensor  # [S, H] float16
    teacher_ids: torch.Tensor  # [M, k] long, at the measured positions
    teacher_logp: torch.Tensor  # [M, k] float32


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
    """The frozen base on sequences of equal length in one call: per row, the cached layers' states (float16) and
    the final one (key 0, as computed: the teacher is taken from it) [S, H]. Without `final` the base stops after
    the last of `layers` (no key 0)."""
    wanted = set(layers)
    hi = adapter.num_layers if final else max(layers)
    states: dict[int, torch.Tensor] = {}

    def on_layer(i: int, _h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        if i + 1 in wanted:
            states[i + 1] = h_out.to(torch.float16)

    x = torch.tensor(rows, dtype=torch.long, device=adapter.device)
    positions = torch.arange(x.shape[1], device=x.device)[None].expand_as(x)
    out = adapter.forward_layers(adapter.embed(x), positions, 0, hi, None, on_layer=on_layer)
    if final:
        states[0] = out
    return [{k: v[r].cpu() for k, v in states.items()} for r in range(len(rows))]


@torch.no_grad()
def make_sequence(
    adapter: Any, ids: list[int], measured: torch.Tensor, states: dict[int, torch.Tensor], k: int
) -> Sequence:
    """A sequence from its states (key 0: the final one): the teacher's top-k at the measured positions."""
    from eectl.heads.losses import TeacherTopK

    final = states[0]
    teacher = TeacherTopK.of(adapter.logits(final[measured].float()), k)
    layers = {layer: h for layer, h in states.items() if layer != 0}
    return Sequence(
        torch.tensor(ids, dtype=torch.long),
        measured,
        layers,
        final.to(torch.float16),
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
        # so are the batch sizes, which change how fast, not what
        "spec": {
            k: v
            for k, v in {**asdict(spec), "layers": sorted(spec.layers)}.items()
            if k not in _BUDGETS + ("gen_batch", "text_batch")
        },
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
    refused, an identical one is reused, a complete one that lacks only some of the layers is widened to them
    (`widen_cache`). Text chunks first, then generated sequences, per split."""
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
            if _only_layers_differ(old.get("identity"), identity):
                if old.get("complete") and old.get("budgets") == {k: getattr(spec, k) for k in _BUDGETS}:
                    return widen_cache(loaded, folder, spec.layers, spec.text_batch, on_tokens, log)
                raise UsageError(
                    f"{folder} holds a state cache of other layers that is incomplete or has other token budgets",
                    hint="finish or widen it with its own budgets first (see its cache.json), then change one thing",
                )
            raise UsageError(
                f"{folder} holds a state cache of another model, data or spec",
                hint="pass another --cache folder, or delete this one",
            )
        if old.get("complete") and old.get("budgets") == {k: getattr(spec, k) for k in _BUDGETS}:
            return open_cache(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps({"identity": identity, "complete": False})))
    start = time.perf_counter()
    timing = Timing()
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
            entries += _cache_text(adapter, tok, folder, split, part, n_text, spec, timing, on_tokens)
        if n_gen > 0:
            entries += _cache_generated(adapter, tok, folder, split, part, n_gen, spec, timing, on_tokens)
        say(f"state cache: {split} part done ({sum(e.tokens for e in entries if e.split == split)} tokens)")
    build_s = time.perf_counter() - start
    doc = {
        "identity": identity,
        "complete": True,
        "budgets": {k: getattr(spec, k) for k in _BUDGETS},
        "build_s": build_s,
        "timing": dict(timing),
        "entries": [asdict(e) for e in entries],
    }
    _atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8"))
    return StateCache(folder, identity, entries, build_s, dict(timing))


def _only_layers_differ(old: Any, new: dict[str, Any]) -> bool:
    """Two cache identities that are equal but for the spec's layers."""
    if not isinstance(old, dict) or not isinstance(old.get("spec"), dict):
        return False
    return {**old, "spec": {**old["spec"], "layers": None}} == {**new, "spec": {**new["spec"], "layers": None}}


def widen_cache(
    loaded: Any,
    folder: Path,
    layers: list[int],
    batch: int = 4,
    on_tokens: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> StateCache:
    """Add the states of `layers` the complete cache in `folder` does not hold to every sequence file (teacher-forced
    on its stored ids, `batch` sequences of equal length per base call), then name the union in `cache.json`.
    `on_tokens` counts measured tokens per file done (files already widened first), as the build does."""
    from safetensors import safe_open

    from eectl.files import atomic_write as _atomic_write

    say = log or (lambda _m: None)
    cache = open_cache(folder)
    doc = json.loads((folder / "cache.json").read_text(encoding="utf-8"))
    adapter = loaded.adapter
    new = sorted(set(layers) - set(cache.layers))
    if not new:
        return cache
    CacheSpec(layers=new).check(adapter.num_layers)
    names = {f"state_{layer}" for layer in new}
    todo: list[Entry] = []
    skipped = 0
    for entry in _widen_order(cache.entries):
        with safe_open(str(folder / entry.file), framework="pt") as f:  # type: ignore[no-untyped-call]
            have = set(f.keys())
        if names <= have:
            skipped += entry.tokens
        else:
            todo.append(entry)
    say(f"state cache: widening {len(todo)} of {len(cache.entries)} sequences to layers {new} (the others hold them)")
    if on_tokens is not None:
        on_tokens(skipped)
    start = time.perf_counter()
    positions = 0
    window = 16 * batch  # sequences per window, batched by equal length inside it (no padding)
    for w0 in range(0, len(todo), window):
        groups: dict[int, list[Entry]] = {}
        for entry in todo[w0 : w0 + window]:
            groups.setdefault(entry.length, []).append(entry)
        for group in groups.values():
            for g0 in range(0, len(group), batch):
                part = group[g0 : g0 + batch]
                seqs = [read_sequence(folder / e.file) for e in part]
                states = base_states(adapter, [s.ids.tolist() for s in seqs], new, final=False)
                for entry, seq, st in zip(part, seqs, states, strict=True):
                    seq.states.update(st)
                    write_sequence(folder / entry.file, seq)
                    positions += entry.length
                    if on_tokens is not None:
                        on_tokens(entry.tokens)
    widen_s = time.perf_counter() - start
    say(
        f"state cache: widened {len(todo)} sequences ({positions} positions) in {widen_s:.0f} s, "
        f"{positions / max(widen_s, 1e-9):.0f} positions/s"
    )
    doc["identity"]["spec"]["layers"] = sorted(set(cache.layers) | set(new))
    doc["timing"] = {**doc.get("timing", {}), "widen": doc.get("timing", {}).get("widen", 0.0) + widen_s}
    doc["build_s"] = float(doc.get("build_s", 0.0)) + widen_s
    _atomic_write(folder / "cache.json", lambda tmp: tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8"))
    return open_cache(folder)


def _widen_order(entries: list[Entry]) -> list[Entry]:
    """The order a widen takes: the held-out split first (every evaluation reads all of it), then the training split
    with its sources interleaved in proportion, so a widen stopped early has widened a sample of the training data
    that is mixed as the whole is (text chunks and generated sequences), not only its first source."""
    by_source: dict[tuple[str, str], list[Entry]] = {}
    for entry in entries:
        by_source.setdefault((entry.split, entry.source), []).append(entry)
    keyed = [
        (split == "train", i / len(group), source, e)
        for (split, source), group in by_source.items()
        for i, e in enumerate(group)
    ]
    return [e for *_k, e in sorted(keyed, key=lambda k: k[:3])]


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
    timing: Timing,
    on_tokens: Callable[[int], None] | None,
) -> list[Entry]:
    """The split's teacher-forced chunks, each computed unless its file is already there, `text_batch` at a time."""
    from eectl.data import token_chunks

    skip_first = 1 if getattr(tok, "bos_token_id", None) is not None else 0
    body = spec.chunk_len - skip_first  # whole chunks only, so a larger budget extends the same chunks
    n_whole = math.ceil(n_text / body) * body if split == "train" else n_text
    entries, todo = [], []
    chunks = [c[0].tolist() for c in token_chunks(tok, part, n_whole, spec.chunk_len)]
    for u, ids in enumerate(chunks):
        name = f"{split}/text_{u:06d}.safetensors"
        if not (folder / name).is_file():
            todo.append((name, ids))
        entries.append(Entry(split, "text", name, len(ids) - skip_first, len(ids)))
    done = {e.file: e.tokens for e in entries} if on_tokens is not None else {}
    if on_tokens is not None:
        on_tokens(sum(done.values()) - sum(done[n] for n, _ in todo))
    # equal lengths batch without padding (only a split's last chunk may be shorter)
    groups: dict[int, list[tuple[str, list[int]]]] = {}
    for name, ids in todo:
        groups.setdefault(len(ids), []).append((name, ids))
    for group in groups.values():
        for g0 in range(0, len(group), spec.text_batch):
            part_ = group[g0 : g0 + spec.text_batch]
            t = time.perf_counter()
            states = base_states(adapter, [ids for _, ids in part_], spec.layers)
            t = timing.add("text base", t)
            for (name, ids), st in zip(part_, states, strict=True):
                measured = torch.zeros(len(ids), dtype=torch.bool)
                measured[skip_first:] = True
                seq = make_sequence(adapter, ids, measured, st, spec.teacher_k)
                t = timing.add("teacher", t)
                write_sequence(folder / name, seq)
                t = timing.add("write", t)
                if on_tokens is not None:
                    on_tokens(done[name])
    return entries


def _cache_generated(
    adapter: Any,
    tok: Any,
    folder: Path,
    split: str,
    part: Any,
    n_gen: int,
    spec: CacheSpec,
    timing: Timing,
    on_tokens: Callable[[int], None] | None,
) -> list[Entry]:
    """The split's prompts + greedy continuations until `n_gen` measured tokens; files already there are kept.
    The generation keeps the states it computes (calibrate's generator with `keep`): the base does not run
    again on the generated sequences."""
    from eectl.exits.measure import Keep, generate_continuations, prompt_ids

    max_prompt = max(8, min(adapter.dims.max_positions, 4096) - spec.gen_len - 1)
    prompts = prompt_ids(tok, part.prompts, max_prompt, spec.raw)
    eos = getattr(tok, "eos_token_id", None)
    entries: list[Entry] = []
    got = 0
    window = spec.gen_batch * 4  # prompts per call: sorted by length into batches there, files written after it
    for b0 in range(0, len(prompts), window):
        if got >= n_gen:
            break
        members = range(b0, min(b0 + window, len(prompts)))
        todo = [i for i in members if not (folder / f"{split}/gen_{i:06d}.safetensors").is_file()]
        if todo:
            t = time.perf_counter()
            conts, _ = generate_continuations(
                adapter,
                [prompts[i] for i in todo],
                min(len(todo) * spec.gen_len, n_gen - got),
                spec.gen_len,
                eos,
                spec.gen_batch,
                keep=Keep(spec.layers, float16=True),
            )
            t = timing.add("generation", t)
            for c in conts:
                assert c.states is not None
                p, n = len(c.prompt), len(c.generated)
                # position j predicts token j + 1: the last prompt position predicts the first continuation token;
                # the last generated token is only a label (no step fed it), so the sequence ends before it
                ids = (c.prompt + c.generated)[: p + n - 1]
                measured = torch.zeros(len(ids), dtype=torch.bool)
                measured[p - 1 :] = True
                seq = make_sequence(adapter, ids, measured, c.states, spec.teacher_k)
                t = timing.add("teacher", t)
                write_sequence(folder / f"{split}/gen_{todo[c.unit]:06d}.safetensors", seq)
                t = timing.add("write", t)
        for i in members:
            name = f"{split}/gen_{i:06d}.safetensors"
            if got >= n_gen or not (folder / name).is_file():
                continue
            n, length = _counts(folder / name)
            entries.append(Entry(split, "gen", name, n, length))
            got += n
            if on_tokens is not None:
                on_tokens(n)
    if got < n_gen:
        raise DataError(
            f"the {split} part's {len(prompts)} prompts gave only {got} generated tokens, fewer than {n_gen}",
            hint="lower the generated token budget or pass more data",
        )
    return entries


def _counts(path: Path) -> tuple[int, int]:
    """A sequence file's measured positions and length, without reading its states."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # type: ignore[no-untyped-call]
        measured = f.get_tensor("measured")
    return int(measured.sum()), int(measured.numel())


def open_cache(folder: Path) -> StateCache:
    meta_path = folder / "cache.json"
    if not meta_path.is_file():
        raise UsageError(f"no state cache in {folder}", hint="build one with scripts or `eectl train-heads --cache`")
    doc = json.loads(meta_path.read_text(encoding="utf-8"))
    if not doc.get("complete"):
        raise UsageError(f"the state cache in {folder} is incomplete", hint="run the build again to finish it")
    entries = [Entry(**e) for e in doc["entries"]]
    return StateCache(folder, doc["identity"], entries, float(doc.get("build_s", 0)), doc.get("timing", {}))
