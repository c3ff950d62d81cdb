"""The Python API: `load(artifact, **run_options)` -> `Model`, whose `generate` and `chat` return a `Completion` (the
text, its tokens, timings and exit statistics) or, streaming, an iterator of text pieces.

A Model is an artifact opened once (its runtime, tokenizer and plan, as `eectl run` opens it: run/generate.py) with
an `Engine` (run/engine.py) stepping its requests: calls from several threads share the batch (`max_batch` slots),
each call's tokens the same as it would get alone (a sampled call's too, for its `seed`: each call samples with its
own settings and generator). `Model.start` is the non-blocking form the server builds on.

What this module does not do: speak HTTP (eectl/serve), print, or set up torch (nothing here imports it).
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

from eectl.api.text import TextStream, render
from eectl.errors import UsageError
from eectl.run.engine import Engine, Job, Sampling, describe
from eectl.run.generate import RunOptions, check_options, open_artifact
from eectl.runtime.state import Generation

Messages = Sequence[dict[str, str]]  # [{"role": "user", "content": "..."}, ...]
DEFAULT_CONTEXT = 2048  # positions per slot (prompt + answer) where the model allows more
# RunOptions fields `load` does not take: the engine sets them (batch_size: max_batch) or `load` does (threads)
_NOT_OPTIONS = ("batch_size",)


@dataclass
class Completion:
    """One answer: its text (cut before a stop string), every token generated, why it ended ("stop": an end of
    sequence or a stop string; "length": the token budget; "cancelled"), and the row's timings and exit statistics
    (`generation`: None where it was cancelled before its first token)."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str
    generation: Generation | None
    num_layers: int

    @property
    def ttft_s(self) -> float | None:
        """Seconds to the first token (its step's time: the prompt's prefill, with the batch's other rows)."""
        return None if self.generation is None else self.generation.ttft_s

    @property
    def tokens_per_s(self) -> float:
        return 0.0 if self.generation is None else self.generation.tokens_per_s

    @property
    def mean_layers(self) -> float:
        """Layers run per generated token on average (the model's depth where every token ran full depth)."""
        return float(self.num_layers) if self.generation is None else self.generation.mean_layers(self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        g = self.generation
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "tokens_per_s": self.tokens_per_s,
            "latencies_s": [] if g is None else g.latencies_s,
            "exit_layers": [] if g is None else g.exit_layers,
            "mean_executed_layers": self.mean_layers,
            "drafted": 0 if g is None else g.drafted + g.prompt_drafted,
            "rejected_drafts": 0 if g is None else g.rejected_drafts,
        }


class Request:
    """A started generation (`Model.start`): `on_text(piece)` gets the text as it settles, `on_end(completion,
    error)` its end, both on the engine's thread. `cancel()` frees its slot at the next step."""

    def __init__(
        self,
        model: Model,
        ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
        on_text: Callable[[str], None] | None,
        on_end: Callable[[Completion | None, BaseException | None], None],
    ) -> None:
        self.model, self.ids, self.max_new_tokens = model, ids, max_new_tokens
        self.text = TextStream(model.tokenizer, stop)
        self.on_text, self.on_end = on_text, on_end
        self.job = Job(ids, max_new_tokens, sampling, on_step=self._step, on_done=self._done)

    def cancel(self) -> None:
        self.job.cancel()

    def _step(self, confirmed: list[int]) -> None:
        piece = self.text.update(confirmed)
        if piece and self.on_text is not None:
            self.on_text(piece)
        if self.text.stopped:
            self.job.cancel()  # a stop string: the row leaves at the next step

    def _done(self, gen: Generation | None, error: BaseException | None) -> None:
        if error is not None:
            self.on_end(None, error)
            return
        tokens = [] if gen is None else list(gen.token_ids)
        piece = self.text.finish(tokens)
        if piece and self.on_text is not None:
            self.on_text(piece)
        stops = self.model.runtime.manifest.eos_token_ids
        if self.text.stopped or (tokens and tokens[-1] in stops):
            reason = "stop"
        elif len(tokens) >= self.max_new_tokens:
            reason = "length"
        else:
            reason = "cancelled"
        L = self.model.runtime.manifest.num_layers
        self.on_end(Completion(self.text.sent_text, tokens, len(self.ids), reason, gen, L), None)


class Streaming:
    """The text pieces of a streamed answer as they settle; `completion` once the iteration ended. Closing it (or
    leaving a for loop early) cancels the answer."""

    def __init__(self, start: Callable[[Callable[[str], None], Callable[..., None]], Request]) -> None:
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.completion: Completion | None = None
        self._request = start(
            lambda piece: self._events.put(("text", piece)), lambda c, e: self._events.put(("end", (c, e)))
        )
        self._ended = False

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._ended:
            raise StopIteration
        kind, value = self._events.get()
        if kind == "text":
            return str(value)
        self._ended = True
        completion, error = value
        if error is not None:
            raise error
        self.completion = completion
        raise StopIteration

    def close(self) -> None:
        if not self._ended:
            self._request.cancel()
            while not self._ended:  # the end arrives at the engine's next step
                try:
                    next(self)
                except StopIteration:
                    break

    def __del__(self) -> None:
        if not self._ended:
            self._request.cancel()


class Model:
    """An artifact opened for generation. Thread-safe: calls from several threads share the engine's batch."""

    def __init__(self, artifact: str | Path, opts: RunOptions, engine_args: dict[str, Any], **log: Any) -> None:
        self.artifact = str(artifact)
        self.options = opts
        self.runtime, self.tokenizer = open_artifact(artifact, opts, log.get("note"))
        self.engine = Engine(self.runtime, opts, **engine_args, **log)

    @property
    def name(self) -> str:
        """The artifact's folder name (what /v1/models lists)."""
        return Path(self.artifact).resolve().name

    @property
    def config(self) -> dict[str, Any]:
        """What the default sampling setting runs: policy, exits, signal, drafts, and how it was chosen."""
        return describe(self.engine.config())

    def tokenize(self, prompt: str | Messages, raw: bool | None = None) -> list[int]:
        """The ids the model reads: a string through the chat template unless raw (as `eectl run PROMPT`), messages
        through it always (or, raw or without a template, each message's content on its own line)."""
        return render(self.tokenizer, prompt, self.options.raw if raw is None else raw)

    def start(
        self,
        ids: list[int],
        on_end: Callable[[Completion | None, BaseException | None], None],
        on_text: Callable[[str], None] | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
    ) -> Request:
        """Queue a generation for `ids` and return at once (the engine's errors, e.g. a full queue, raised here)."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        sampling = self._sampling(temperature, top_p, seed)
        n = self.options.max_new_tokens if max_new_tokens is None else max_new_tokens
        req = Request(self, ids, n, sampling, stops, on_text, on_end)
        self.engine.submit(req.job)
        return req

    @overload
    def generate(
        self,
        prompt: str | Messages,
        *,
        max_new_tokens: int | None = ...,
        temperature: float | None = ...,
        top_p: float | None = ...,
        stop: str | Sequence[str] | None = ...,
        seed: int | None = ...,
        stream: Literal[False] = ...,
        raw: bool | None = ...,
    ) -> Completion: ...

    @overload
    def generate(
        self,
        prompt: str | Messages,
        *,
        max_new_tokens: int | None = ...,
        temperature: float | None = ...,
        top_p: float | None = ...,
        stop: str | Sequence[str] | None = ...,
        seed: int | None = ...,
        stream: Literal[True],
        raw: bool | None = ...,
    ) -> Streaming: ...

    def generate(
        self,
        prompt: str | Messages,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        stream: bool = False,
        raw: bool | None = None,
    ) -> Completion | Streaming:
        """Generate an answer to a prompt (or messages): a Completion, or with stream=True the text pieces as they
        settle. None takes the load options' value (max_new_tokens, temperature, top_p, raw). `seed` (sampling): the
        answer's own generator's, so the same seed and settings give the same answer alone or beside other calls;
        None: a seed drawn from the model's generator (seeded by `load`'s `seed`) as the call starts decoding."""
        ids = self.tokenize(prompt, raw)
        args: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        args.update(stop=stop, seed=seed)
        if stream:
            return Streaming(lambda on_text, on_end: self.start(ids, on_end, on_text, **args))
        done: queue.Queue[tuple[Completion | None, BaseException | None]] = queue.Queue()
        req = self.start(ids, lambda c, e: done.put((c, e)), **args)
        try:
            completion, error = done.get()
        except BaseException:  # Ctrl-C while waiting: the row leaves the batch
            req.cancel()
            raise
        if error is not None:
            raise error
        assert completion is not None
        return completion

    def chat(self, messages: str | Messages, **kwargs: Any) -> Any:
        """`generate` on a conversation (a string: one user message), always through the chat template."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.generate(messages, **kwargs)

    def close(self) -> None:
        """End the engine (requests in flight are cancelled)."""
        self.engine.stop()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _sampling(self, temperature: float | None, top_p: float | None, seed: int | None) -> Sampling:
        t = self.options.temperature if temperature is None else temperature
        p = self.options.top_p if top_p is None else top_p
        check_options(
            dataclasses.replace(self.options, temperature=t, top_p=p, seed=self.options.seed if seed is None else seed)
        )
        return Sampling(float(t), float(p), None if seed is None else int(seed))


def load(
    artifact: str | Path,
    *,
    max_batch: int = 1,
    context: int | None = None,
    max_queue: int = 64,
    max_prefills: int | None = None,
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
    **run_options: Any,
) -> Model:
    """Open an exported artifact for generation. `run_options`: `eectl run`'s options by their RunOptions names
    (exits, policy, thresholds, signal, max_new_tokens, temperature, top_p, seed, raw, provider, threads, ...):
    max_new_tokens, temperature and top_p are the calls' defaults. `max_batch`: requests decoded together (from
    several threads or a server); `context`: positions per request (prompt + answer; default min(2048, the
    model's)); `max_queue`: requests waiting for a slot before `QueueFull`; `max_prefills`: new requests seated per
    step while others decode (None: every free slot; run/engine.py `Engine`). `warn`/`note`: where the run's warnings
    and the plan's line go (nowhere by default)."""
    from eectl.runtime.ort import init_ort

    known = {f.name for f in dataclasses.fields(RunOptions)} - set(_NOT_OPTIONS)
    unknown = sorted(set(run_options) - known)
    if unknown:
        raise UsageError(f"unknown run option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    run_options["threads"] = init_ort(run_options.get("threads"))  # one pool per process (the CLI's set_threads)
    opts = RunOptions(**run_options)
    check_options(opts)
    engine_args: dict[str, Any] = {"slots": max_batch, "context": context or DEFAULT_CONTEXT, "queue": max_queue}
    engine_args["admit"] = max_prefills
    return Model(artifact, opts, engine_args, warn=warn, note=note)
