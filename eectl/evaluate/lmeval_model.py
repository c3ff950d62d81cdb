"""The lm-eval model class `eectl` (registered in lm-eval's model registry on import): requests through the runner.

Imported by lmeval.make_lm_class on first use only, so that importing eectl never needs lm_eval. How each request
type maps onto the runner is described in evaluate/lmeval.py.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import _add_special_kwargs, handle_stop_sequences, normalize_gen_kwargs
from lm_eval.models.utils import postprocess_generated_text as cut_at_stops
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from eectl.errors import UsageError
from eectl.evaluate.lmeval_stats import DEFAULT_BATCH, DEFAULT_MAX_GEN_TOKS, EvalStats
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.policies import POLICIES
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime


class _Stop(Exception):
    """Raised from the runner's step callback once a stop string is confirmed: ends that generation early."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


@register_model("eectl")
class EectlLM(TemplateLM):  # type: ignore[misc]
    """lm-eval model over an eectl artifact. model_args: artifact, exits ('none' = full depth), policy,
    thresholds, threshold_scale, signal, top_k, max_length, max_gen_toks, batch_size (texts scored per pass),
    threads, provider, add_bos_token."""

    def __init__(
        self,
        artifact: str,
        exits: str | None = None,
        policy: str = "defer",
        thresholds: str | None = None,
        threshold_scale: float = 1.0,
        signal: str | None = None,
        top_k: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        batch_size: int | str = DEFAULT_BATCH,
        threads: int | None = None,
        provider: str = "cpu",
        add_bos_token: bool | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        self.rt = ArtifactRuntime(artifact, provider=provider, threads=threads)
        m = self.rt.manifest
        self.tokenizer = load_tokenizer(self.rt)
        self.add_bos_token = add_bos_token
        self._max_length = int(max_length) if max_length else _max_length(m, self.tokenizer)
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = _batch_size(batch_size)
        opts = RunOptions(
            exits=None if exits is None else str(exits),
            policy=policy,
            thresholds=None if thresholds is None else str(thresholds),
            threshold_scale=float(threshold_scale),
            signal=signal,
            top_k=None if top_k is None else int(top_k),
            max_new_tokens=self.max_gen_toks,
            provider=provider,
        )
        self.config = resolve_config(self.rt, opts, tuple(m.eos_token_ids))
        self._runners: dict[int, Runner] = {}
        # verify's output is full depth by construction, so it scores at full depth (score covers copy/defer)
        kind = POLICIES[self.config.policy]
        self.scorer: Runner | None = None
        if kind.lossless or not self.config.exits:  # output equals full depth: score at full depth
            self.scorer = Runner(self.rt, dataclasses.replace(self.config, exits=[], policy="defer", prompt_drafts=0))
        elif kind.scores_text:
            self.scorer = Runner(self.rt, self.config)
        self.stats = EvalStats()

    # --- what TemplateLM needs -------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw: Any) -> list[int]:
        from lm_eval.models.utils import has_bos_prefix

        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, **special))

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kw: Any
    ) -> list[tuple[float, bool]]:
        if self.scorer is None:
            raise UsageError(f"the {self.config.policy} policy cannot score text (loglikelihood tasks)")
        texts = []
        for _, context_enc, continuation_enc in requests:
            # as HFLM: keep the last max_length + 1 tokens; the model sees all but the last one
            ids = (context_enc + continuation_enc)[-(self.max_length + 1) :]
            prompt_len = len(ids) - len(continuation_enc)
            if prompt_len < 1:
                raise UsageError("a continuation longer than the maximum context is not supported")
            texts.append((ids, prompt_len))
        t0 = time.perf_counter()
        scored = self.scorer.score_many(texts, rows=self.batch_size)  # one pass per batch where the policy allows
        self.stats.add_scoring(sum(len(ids) - 1 for ids, _ in texts), time.perf_counter() - t0)
        out = []
        for (key, _, _), (ids, prompt_len), got in zip(requests, texts, scored, strict=True):
            self.stats.add(got.layers, self.rt.manifest.num_layers)
            res = (-float(np.sum(got.nll)), got.greedy == ids[prompt_len:])
            out.append(res)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in [req.args for req in requests]:
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            out.append(sum(s for s, _ in scores))
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results = []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                raise UsageError("eectl eval generates greedily (the tasks' do_sample must be false)")
            max_ctx = self.max_length - max_gen_toks
            if max_ctx <= 0:
                raise UsageError(f"max_gen_toks {max_gen_toks} must be below max_length {self.max_length}")
            special = {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}
            ids = list(self.tokenizer(context, **special)["input_ids"])[-max_ctx:]
            t0 = time.perf_counter()
            tokens = self._generate(ids, max_gen_toks, until)
            text = cut_at_stops(generation=self.tok_decode(tokens), stop=until, think_end_token=None)
            self.stats.add_generation(len(self.tok_encode(text, add_special_tokens=False)), time.perf_counter() - t0)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results

    def _generate(self, ids: list[int], max_new: int, until: list[str]) -> list[int]:
        runner = self._runners.get(max_new)
        if runner is None:
            runner = Runner(self.rt, dataclasses.replace(self.config, max_new_tokens=max_new))
            self._runners[max_new] = runner
        tail = max((len(u) for u in until), default=0) + 8  # characters of decoded tail worth checking

        def stop_when_seen(row: int, confirmed: list[int]) -> None:
            # the decoded tail of the confirmed tokens: a stop string there ends the generation (HF stops the
            # same way; the text is cut at the stop string afterwards, so both give the same result)
            text = self.tok_decode(confirmed[-tail:])
            if any(u and u in text for u in until):
                raise _Stop(list(confirmed))

        try:
            g = runner.generate([ids], on_step=stop_when_seen)[0]
            tokens, layers = g.token_ids, g.exit_layers
        except _Stop as stop:
            tokens, layers = stop.tokens, []
        self.stats.add(layers, self.rt.manifest.num_layers)
        return tokens


def _batch_size(value: int | str) -> int:
    """lm-eval's batch_size model argument: a count of texts scored per pass ('auto' is the default's)."""
    if str(value).startswith("auto"):
        return DEFAULT_BATCH
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"batch_size must be a whole number or auto, got '{value}'") from None
    if not 1 <= n <= 1024:
        raise UsageError(f"batch_size must be in 1..1024, got {n}")
    return n


def _max_length(manifest: Any, tokenizer: Any) -> int:
    """As HFLM: the model's maximum positions (the artifact's), else the tokenizer's, else 2048."""
    n = getattr(manifest, "max_positions", None)
    if n:
        return int(n)
    t = getattr(tokenizer, "model_max_length", None)
    return int(t) if t and t < 1e9 else 2048


def timed_hflm(**kwargs: Any) -> Any:
    """lm-eval's own hf model, counting its request work as EectlLM does (`stats`: positions scored, tokens of the
    returned texts, and the time in its request methods), for eval's throughput column."""
    from lm_eval.models.huggingface import HFLM

    class TimedHFLM(HFLM):  # type: ignore[misc]
        stats = EvalStats()

        def _loglikelihood_tokens(self, requests: list[Any], *args: Any, **kw: Any) -> list[tuple[float, bool]]:
            t0 = time.perf_counter()
            out = super()._loglikelihood_tokens(requests, *args, **kw)
            n = sum(min(len(c + t), self.max_length + 1) - 1 for _, c, t in requests)
            self.stats.add_scoring(n, time.perf_counter() - t0)
            return out  # type: ignore[no-any-return]

        def generate_until(self, requests: list[Any], *args: Any, **kw: Any) -> list[str]:
            t0 = time.perf_counter()
            out = super().generate_until(requests, *args, **kw)
            n = sum(len(self.tok_encode(text, add_special_tokens=False)) for text in out)
            self.stats.add_generation(n, time.perf_counter() - t0)
            return out  # type: ignore[no-any-return]

    lm = TimedHFLM(**kwargs)
    lm.stats = EvalStats()
    return lm
