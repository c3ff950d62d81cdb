"""The OpenAI API's shapes as `eectl serve` speaks them: request bodies read and checked (`chat_request`,
`completion_request`: a bad field is a `BadRequest` naming it), responses and stream chunks built, errors in the
API's error body.

The fields eectl does not implement are refused by name rather than ignored (n > 1, logprobs, tools, penalties):
a client that asked for them would otherwise get an answer that silently differs from what it asked. Fields that
change nothing here (user, metadata, ...) are accepted and ignored. `seed` seeds the request's own generator
(temperature > 0): the same seed, prompt and settings give the same answer whatever else the batch holds; without
one, the request's seed is drawn from the server's generator (`eectl serve --seed`) as it is seated.

What this module does not do: generate (eectl/api), or route (app.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eectl.api.model import Completion
from eectl.contracts.recipe import MAX_SEED


class BadRequest(Exception):
    """A request the server refuses: HTTP `status`, the OpenAI error `type`, and the field at fault (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionBody(_Body):
    prompt: str | list[str]


# fields that ask for something eectl does not do: refused by name (a value that asks for nothing passes)
_UNSUPPORTED = {
    "n": lambda v: v != 1,
    "logprobs": lambda v: bool(v),
    "top_logprobs": lambda v: bool(v),
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "response_format": lambda v: bool(v) and v.get("type") not in (None, "text"),
    "presence_penalty": lambda v: bool(v),
    "frequency_penalty": lambda v: bool(v),
    "logit_bias": lambda v: bool(v),
    "best_of": lambda v: v not in (None, 1),
    "echo": lambda v: bool(v),
    "suffix": lambda v: bool(v),
}
MAX_STOPS = 4  # as OpenAI's API


@dataclass
class Asked:
    """What a request asks the model for, checked."""

    prompt: str | list[dict[str, str]]  # completions: the text (fed raw); chat: the messages
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: list[str]
    stream: bool
    usage_in_stream: bool  # stream_options.include_usage: a last chunk with the usage
    seed: int | None = None  # the request's generator's (None: drawn from the server's)


def _parse(cls: type[_Body], doc: Any) -> Any:
    if not isinstance(doc, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        body = cls.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise BadRequest(f"{param}: {err['msg']}", param) from None
    for name, refused in _UNSUPPORTED.items():
        value = doc.get(name)
        if value is not None and refused(value):
            raise BadRequest(f"{name}={value!r} is not supported by eectl serve", name)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"stop: at most {MAX_STOPS} sequences, got {len(stops)}", "stop")
    return body, stops


def chat_request(doc: Any) -> Asked:
    body, stops = _parse(ChatBody, doc)
    messages = []
    for i, m in enumerate(body.messages):
        if m.role not in ("system", "user", "assistant", "developer"):
            raise BadRequest(f"messages[{i}].role: {m.role!r} is not one of system, user, assistant", f"messages.{i}")
        content = m.content
        if isinstance(content, list):  # content parts: the text ones, joined
            if any(p.get("type") != "text" for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages.{i}.content")
            content = "".join(str(p.get("text", "")) for p in content)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    if not messages:
        raise BadRequest("messages: at least one message is required", "messages")
    budget = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _asked(body, messages, budget, stops)


def completion_request(doc: Any) -> Asked:
    body, stops = _parse(CompletionBody, doc)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest("prompt: one prompt per request (a list of one string at most)", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise BadRequest("prompt: empty", "prompt")
    return _asked(body, prompt, body.max_tokens, stops)


def _asked(body: _Body, prompt: Any, budget: int | None, stops: list[str]) -> Asked:
    usage = bool((body.stream_options or {}).get("include_usage"))
    return Asked(prompt, budget, body.temperature, body.top_p, stops, body.stream, usage, body.seed)


# --- responses ------------------------------------------------------------------------------------------------------
class Reply:
    """One response's id, creation time and model name, and the bodies and chunks carrying them."""

    def __init__(self, model: str, chat: bool) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model, self.chat = model, chat

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, done: Completion) -> dict[str, Any]:
        """The non-streamed response, with eectl's own fields under "eectl" (tokens, timings, exits)."""
        reason = _reason(done.finish_reason)
        if self.chat:
            message = {"role": "assistant", "content": done.text}
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": done.text, "finish_reason": reason, "logprobs": None}
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": [choice], "usage": usage(done), "eectl": done.to_dict()}

    def chunk(self, text: str | None = None, reason: str | None = None, first: bool = False) -> dict[str, Any]:
        """A stream chunk: a piece of text, or the last one with the finish reason."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, done: Completion) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage(done), "eectl": done.to_dict()}


def usage(done: Completion) -> dict[str, int]:
    n = len(done.tokens)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": n, "total_tokens": done.prompt_tokens + n}


def _reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"
