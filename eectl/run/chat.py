"""`eectl run --chat`: an interactive conversation on an artifact, its KV cache kept across turns.

Each user line becomes a turn: the conversation so far is rendered with the tokenizer's chat template (a
generation prompt after it), and the runtime's `Conversation` feeds only what its cache does not hold yet. The reply
streams as it settles (under verify: up to the first unchecked draft). Ctrl-C during a reply ends that reply (the
conversation goes on); end of input (Ctrl-D) ends the conversation.

What this module does not do: choose exits (the runner), or print (the callbacks it is given).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eectl.data import chat_ids
from eectl.parsing import check_text
from eectl.run.generate import RunOptions, RunReport, open_runner
from eectl.runtime.conversation import Conversation

DEFAULT_CONTEXT = 4096  # cache positions of a conversation when the model allows more


def conversation_ids(tokenizer: Any, messages: list[dict[str, str]], raw: bool, history: list[int]) -> list[int]:
    """The conversation as the model reads it: its chat template with a generation prompt; or (raw, or no
    template) the tokens so far (`history`: the previous turns and replies as generated) and the new line's."""
    check_text(messages[-1]["content"], "the turn")  # bytes that are not UTF-8 on stdin: one line, not a TypeError
    if not raw and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, messages)
    line = messages[-1]["content"] + "\n"
    return history + [int(i) for i in tokenizer(line, add_special_tokens=not history)["input_ids"]]


def chat(
    artifact: str | Path,
    opts: RunOptions,
    read: Callable[[], str | None],
    write: Callable[[str], None],
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
    context: int | None = None,
) -> tuple[Any, list[RunReport], list[int]]:
    """Turns until `read()` returns None; `write(text)` gets each reply's text as it settles. Returns the runtime,
    one report per turn, and per turn how many of its input tokens the cache already held."""
    rt, tok, _, runner = open_runner(artifact, opts, warn, note)
    conv = Conversation(runner, context or min(rt.manifest.max_positions, DEFAULT_CONTEXT))
    messages: list[dict[str, str]] = []
    reports: list[RunReport] = []
    reused: list[int] = []
    stopped = [False]

    def interrupt(signum: int, frame: Any) -> None:
        stopped[0] = True

    while (line := read()) is not None:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        shown = [0]

        def stream(confirmed: list[int], shown: list[int] = shown) -> None:
            text = tok.decode(confirmed, skip_special_tokens=True)
            write(text[shown[0] :])
            shown[0] = len(text)

        stopped[0] = False
        previous = signal.signal(signal.SIGINT, interrupt)
        try:
            ids = conversation_ids(tok, messages, opts.raw, [] if conv.state is None else conv.state.tokens)
            gen = conv.turn(ids, on_step=stream, stop=lambda: stopped[0])
        finally:
            signal.signal(signal.SIGINT, previous)
        reply = tok.decode(gen.token_ids, skip_special_tokens=True)
        write(reply[shown[0] :] + "\n")
        messages.append({"role": "assistant", "content": reply})
        reports.append(RunReport(line.strip(), reply, gen, rt.manifest.num_layers))
        reused.append(conv.reused)
    return rt, reports, reused
