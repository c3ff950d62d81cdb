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
    stop string appears, the text ends before it (`stopped`).

    The tokens are decoded incrementally (as TGI and vLLM do): each step decodes a window from the last piece's
    tokens on and keeps what it adds to that piece's own decoding, so a step costs the window, not the answer; the
    window's first tokens give a tokenizer that drops a leading space at a sequence's start the same text as the
    whole answer's decoding."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.text = ""  # the answer's text decoded so far (whole characters)
        self._window = self._read = 0  # tokens: where the window starts, and where its last piece ended
        self.sent = 0  # characters of the text given out
        self.sent_text = ""
        self.stopped = False

    def update(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self._decode(tokens, final=False)
        cut = self._stop_at()
        if cut is not None:
            self.stopped = True
            return self._give(cut)
        hold = max((self._begins(self.text, s) for s in self.stop), default=0)
        return self._give(len(self.text) - hold)

    def finish(self, tokens: list[int]) -> str:
        """The rest of the text once the answer ended (nothing held back; cut before a stop string)."""
        if self.stopped:
            return ""
        self._decode(tokens, final=True)
        cut = self._stop_at()
        self.stopped = cut is not None
        return self._give(len(self.text) if cut is None else cut)

    def _decode(self, tokens: list[int], final: bool) -> None:
        """The text the tokens past the window's last piece add (none while it ends in an incomplete character: an
        incomplete UTF-8 sequence decodes to U+FFFD until its bytes arrive; at the end, whatever it is)."""
        if len(tokens) <= self._read and not final:
            return
        decode = self.tokenizer.decode
        before = decode(tokens[self._window : self._read], skip_special_tokens=True)
        after = decode(tokens[self._window :], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._window, self._read = self._read, len(tokens)

    @staticmethod
    def _begins(text: str, stop: str) -> int:
        """The length of the longest tail of `text` that begins `stop` (0: none)."""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                return n
        return 0

    def _stop_at(self) -> int | None:
        """Where the first stop string begins (None: none yet). Only the text from a stop's length before the part
        not given out is searched: nothing earlier holds one, or the answer would have stopped there."""
        found = []
        for s in self.stop:
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                found.append(i)
        return min(found) if found else None

    def _give(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece = self.text[self.sent : end]
        self.sent = end
        self.sent_text += piece
        return piece
