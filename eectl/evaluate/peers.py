"""Peers: other runtimes benched beside eectl's configurations (`eectl bench --peer llama.cpp=FILE.gguf`).

llama.cpp runs through llama-cpp-python (the optional extra `eectl[llamacpp]`; imported only when a peer is asked
for) on the same prompt token ids eectl feeds (chat-templated by eectl's tokenizer: llama.cpp never sees text, so
both runtimes see the same prompt), greedy (temperature 0, no repetition penalty), the same token budget and stop
ids, and the bench's thread count for both its decode and its prompt (n_threads, n_threads_batch). Each GGUF gives
two configurations: `llama.cpp` (plain decoding) and `llama.cpp+lookup` (llama-cpp-python's prompt-lookup decoding,
`LlamaPromptLookupDecoding`, its drafts checked by the model's own greedy choice, so lossless up to the rounding of
a batched pass). Like eectl's runners, a peer reuses the prompt prefix it already holds (llama-cpp-python's
prefix match: the chat template's shared beginning) until the bench's repetition starts (`forget_prompts`).

What this module does not do: time, order or repeat the passes (evaluate/timing.py), or turn them into speed and
fidelity figures (evaluate/bench.py, evaluate/stats.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eectl.errors import UsageError

LLAMA_CPP = "llama.cpp"
PEER_RUNTIMES = (LLAMA_CPP,)  # what --peer RUNTIME=FILE may name
LOOKUP_SUFFIX = "+lookup"  # the peer's prompt-lookup decoding, as its own configuration
LOOKUP_DRAFTS = 10  # llama-cpp-python's LlamaPromptLookupDecoding defaults: 10 drafts from a match of up to 2 tokens
LOOKUP_NGRAM = 2
INSTALL = "pip install 'eectl[llamacpp]'"
# a text both tokenizers must split alike (a GGUF of another model, or another tokenizer, is refused)
PROBE_TEXT = "Natalia sold 48 clips in April, and half as many in May. How many clips did she sell?"


@dataclass(frozen=True)
class PeerSpec:
    """One peer configuration: its name in the bench (`llama.cpp`, `llama.cpp+lookup`), the runtime, the GGUF, and
    the prompt-lookup drafts per step (0: plain decoding)."""

    name: str
    runtime: str
    path: str
    lookup: int = 0


def parse_peers(text: str | None) -> dict[str, str]:
    """`--peer llama.cpp=FILE.gguf` -> {runtime: file}; the runtime must be one eectl drives, named once."""
    pairs = [p.split("=", 1) for p in (text or "").split(",") if p.strip()]
    if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise UsageError(f"--peer must be RUNTIME=FILE.gguf (e.g. {LLAMA_CPP}=model.gguf), got '{text}'")
    names = [p[0].strip() for p in pairs]
    if unknown := [n for n in names if n not in PEER_RUNTIMES]:
        raise UsageError(
            f"--peer runtime '{unknown[0]}' is not one eectl drives; choose from {', '.join(PEER_RUNTIMES)}"
        )
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise UsageError(f"--peer names {', '.join(twice)} more than once, got '{text}'")
    return {k.strip(): v.strip() for k, v in pairs}


def peer_specs(peers: dict[str, str]) -> list[PeerSpec]:
    """The configurations the peers give: per runtime, plain decoding and its prompt lookup."""
    out: list[PeerSpec] = []
    for runtime, path in peers.items():
        out.append(PeerSpec(runtime, runtime, path))
        out.append(PeerSpec(runtime + LOOKUP_SUFFIX, runtime, path, lookup=LOOKUP_DRAFTS))
    return out


def check_peers(peers: dict[str, str]) -> None:
    """Before anything loads: every peer's file is there and its runtime importable (else the install line)."""
    for runtime, path in peers.items():
        if not Path(path).is_file():
            raise UsageError(f"--peer {runtime}: no such file {path}")
        if runtime == LLAMA_CPP:
            _llama_cpp()


def default_peers(gguf: Path | None) -> dict[str, str]:
    """The peers a pipeline's bench adds by itself: llama.cpp on the model's own GGUF where the model is one and
    llama-cpp-python is installed (looked up, not imported); none otherwise."""
    import importlib.util

    if gguf is None or not gguf.is_file() or importlib.util.find_spec("llama_cpp") is None:
        return {}
    return {LLAMA_CPP: str(gguf)}


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise UsageError(f"--peer {LLAMA_CPP} needs llama-cpp-python", hint=INSTALL) from None
    return llama_cpp


@dataclass
class PeerGeneration:
    """One prompt's greedy continuation: its tokens (the stop token included, as eectl's), the time to the first
    token and the latency of each later one (seconds)."""

    token_ids: list[int]
    ttft_s: float
    latencies_s: list[float]


class LlamaCppPeer:
    """llama.cpp on one GGUF through llama-cpp-python: greedy generation from token ids, timed per token."""

    def __init__(self, spec: PeerSpec, threads: int, context: int) -> None:
        llama_cpp = _llama_cpp()
        draft = None
        if spec.lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=spec.lookup)
        self.spec = spec
        self.context = context
        self.llm = llama_cpp.Llama(
            model_path=spec.path,
            n_ctx=context,
            n_batch=min(512, context),
            n_threads=threads,
            n_threads_batch=threads,
            seed=0,
            draft_model=draft,
            logits_all=draft is not None,  # llama-cpp-python checks drafts on every position's logits
            verbose=False,
        )

    def vocab_size(self) -> int:
        return int(self.llm.n_vocab())

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self.llm.tokenize(text.encode(), add_bos=False, special=False)]

    def forget_prompts(self) -> None:
        """The next prompt is fed whole (llama-cpp-python keeps the last one's prefix to reuse otherwise)."""
        self.llm.reset()

    def generate(self, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...]) -> PeerGeneration:
        if len(prompt) + max_new_tokens > self.context:
            raise UsageError(
                f"{self.spec.name}: a prompt of {len(prompt)} tokens + {max_new_tokens} exceeds its context"
            )
        tokens: list[int] = []
        stamps: list[float] = []
        start = time.perf_counter()
        gen = self.llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0)
        try:
            for token in gen:
                stamps.append(time.perf_counter())
                tokens.append(int(token))
                if tokens[-1] in stop or len(tokens) >= max_new_tokens:
                    break
        finally:
            gen.close()
        ttft = stamps[0] - start if stamps else 0.0
        return PeerGeneration(tokens, ttft, [b - a for a, b in zip(stamps, stamps[1:], strict=False)])


def open_peers(
    specs: list[PeerSpec], threads: int, context: int, encode: Callable[[str], list[int]], vocab: int | None
) -> dict[str, LlamaCppPeer]:
    """Every asked peer configuration loaded, each checked to share the artifact's tokenizer (its vocabulary size
    and its split of PROBE_TEXT): the same token ids must mean the same text to both runtimes."""
    want = encode(PROBE_TEXT)
    out: dict[str, LlamaCppPeer] = {}
    for spec in specs:
        peer = LlamaCppPeer(spec, threads, context)
        got = peer.tokenize(PROBE_TEXT)
        if (vocab is not None and peer.vocab_size() != vocab) or got != want:
            raise UsageError(
                f"--peer {spec.runtime}: {spec.path} has another tokenizer than the artifact "
                f"(vocabulary {peer.vocab_size()} vs {vocab})",
                hint="give the GGUF of the model the artifact was exported from",
            )
        out[spec.name] = peer
    return out


def peer_note(peers: dict[str, str], threads: int) -> str:
    """What the report's notes say about the peers."""
    version = _version("llama-cpp-python") if LLAMA_CPP in peers else ""
    files = ", ".join(f"{k} {Path(v).name}" for k, v in peers.items())
    return (
        f"peers ({files}): llama-cpp-python {version}, {threads} threads (n_threads and n_threads_batch), greedy on "
        "the same prompt ids and token budget, one prompt at a time in this process (run apart from eectl's "
        "configurations, as hf is; one runtime each, also under --compare); `+lookup`: its LlamaPromptLookupDecoding "
        f"({LOOKUP_DRAFTS} drafts from a match of up to {LOOKUP_NGRAM} tokens, logits of every position kept)"
    )


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def peer_context(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The context a peer needs: the longest prompt, the budget, a step's drafts beyond it; rounded up to 64."""
    need = max((len(p) for p in prompts), default=0) + max_new_tokens + LOOKUP_DRAFTS + 1
    return -(-need // 64) * 64
