"""Text in and out of the API: prompts and conversations rendered to ids (`render`), and an answer's text as it
settles (`TextStream`: pieces that never change afterwards, cut before a stop string).

What this module does not do: generate (run/engine.py), or know about HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eectl.data import chat_ids, encode_prompt
from eectl.errors import UsageError
from eectl.parsing import check_text

ROLES = ("system", "user", "assistant")


def render(tokenizer: Any, prompt: str | Sequence[dict[str, str]], raw: bool) -> list[int]:
    """A string: as `eectl run PROMPT` feeds it (data.py `encode_prompt`: the chat template unless `raw`). Messages:
    the chat template with a generation prompt; raw or without a template, the messages' contents joined by newlines
    (one message: its content as `eectl run --raw` feeds it)."""
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt, raw)
    messages = list(prompt)
    if not messages:
        raise UsageError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UsageError(f"messages[{i}] needs a role ({', '.join(ROLES)}) and a string content")
    if not raw and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, messages)
    text = "\n".join(str(m["content"]) for m in messages)
    check_text(text, "the messages")
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


class TextStream:
    """An answer's text from its confirmed tokens, step by step: `update` returns the new piece that can no longer
    change (held back: a character still incomplete, a tail that may begin a stop string), `finish` the rest. Once a
    stop string appears, the text ends before it (`stopped`)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.sent = 0  # characters of the text given out
        self.sent_text = ""
        self.stopped = False

    def update(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._give(text, cut)
        safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD until its bytes arrive
        hold = max((self._begins(text[:safe], s) for s in self.stop), default=0)
        return self._give(text, safe - hold)

    @staticmethod
    def _begins(text: str, stop: str) -> int:
        """The length of the longest tail of `text` that begins `stop` (0: none)."""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                return n
        return 0

    def finish(self, tokens: list[int]) -> str:
        """The rest of the text once the answer ended (nothing held back; cut before a stop string)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = self._stop_at(text)
        self.stopped = cut is not None
        return self._give(text, len(text) if cut is None else cut)

    def _stop_at(self, text: str) -> int | None:
        found = [i for s in self.stop if (i := text.find(s)) >= 0]
        return min(found) if found else None

    def _give(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        piece = text[self.sent : end]
        self.sent = end
        self.sent_text += piece
        return piece
