"""`eectl serve` driven by the `openai` client, as a user would: the server started on localhost (a free port) on a
tiny artifact, in its own process; chat and completions, streamed and not, equal to `eectl run`'s greedy tokens;
concurrent requests each equal to their answer alone; a client leaving mid-stream frees its slot; a full queue is
429 and a bad request 400 naming its field, both in the OpenAI error body; SIGTERM drains what is in flight and
exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from eectl.cli import app
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from tests.tiny import save_tiny

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["12 clips in April", "the cat sat", "one two three", "a b c d", "hello", "7 more"]
START_S = 180  # a server's start (imports, the artifact's sessions) on a loaded CI machine
LONG = 480  # tokens (of the tiny model's 512 positions) no answer reaches before it is stopped: no end of sequence


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    export_artifact(
        load_model(str(save_tiny("llama", root / "model"))), root / "art", ExportOptions(exits=[2, 4], top_k=8)
    )
    return root / "art"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, artifact: Path, *args: str) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "eectl.cli", "serve", str(artifact), "--port", str(self.port), "-t", "1"]
        self.proc = subprocess.Popen(
            [*cmd, "--exits", "none", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + START_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited: {self.proc.communicate()[1].decode()}")
            try:
                self.health()
                break
            except OSError:
                time.sleep(0.2)
        else:
            self.stop()
            raise AssertionError("the server did not answer /health")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())

    def wait_until(self, check, what: str) -> dict:
        deadline = time.time() + 60
        while time.time() < deadline:
            doc = self.health()
            if check(doc):
                return doc
            time.sleep(0.05)
        raise AssertionError(f"the server never {what}: {self.health()}")

    def stop(self, signalled: bool = False) -> tuple[int, str]:
        """SIGTERM (unless `signalled` already: a second one during its exit would kill it), then its exit."""
        if self.proc.poll() is None and not signalled:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err.decode()


@pytest.fixture(scope="module")
def server(artifact):
    s = Server(artifact, "--max-batch", "4", "--max-queue", "2", "-n", "16")
    try:
        yield s
    finally:
        s.stop()


def _run_tokens(artifact: Path, prompt: str, n: int, *flags: str) -> list[int]:
    """`eectl run`'s greedy tokens for the prompt."""
    got = CliRunner().invoke(app, ["run", str(artifact), prompt, "--exits", "none", "-n", str(n), "--json", *flags])
    assert got.exit_code == 0, got.output
    return json.loads(got.stdout)["results"][0]["token_ids"]


def _chat(server: Server, prompt: str, n: int, **kw):
    messages = [{"role": "user", "content": prompt}]
    return server.client.chat.completions.create(model="art", messages=messages, max_tokens=n, temperature=0, **kw)


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == ["art"]
    doc = server.health()
    assert doc["status"] == "ok" and doc["max_batch"] == 4 and doc["config"]["exits"] == []


def test_greedy_answers_equal_eectl_runs_tokens(server, artifact):
    chat = _chat(server, PROMPTS[0], 8)
    assert chat.model_extra["eectl"]["tokens"] == _run_tokens(artifact, PROMPTS[0], 8)
    assert chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "length"
    text = server.client.completions.create(model="art", prompt=PROMPTS[1], max_tokens=6, temperature=0)
    assert text.model_extra["eectl"]["tokens"] == _run_tokens(artifact, PROMPTS[1], 6, "--raw")
    # a request without max_tokens gets the server's -n, or what the context leaves after the prompt
    assert len(_chat(server, PROMPTS[2], None).model_extra["eectl"]["tokens"]) == 16  # type: ignore[arg-type]
    long = " ".join(["one two three four"] * 30)  # 509 tokens of the tiny model's 512 positions
    n = len(server.client.completions.create(model="art", prompt=long, max_tokens=1).model_extra["eectl"]["tokens"])
    assert n == 1
    rest = server.client.completions.create(model="art", prompt=long).model_extra["eectl"]
    assert rest["prompt_tokens"] > 512 - 16 and len(rest["tokens"]) == 512 - rest["prompt_tokens"] - 1


def test_streamed_answers_equal_the_whole_ones(server):
    whole = _chat(server, PROMPTS[3], 12)
    chunks = list(_chat(server, PROMPTS[3], 12, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].model_extra["eectl"]["tokens"] == whole.model_extra["eectl"]["tokens"]
    pieces = server.client.completions.create(model="art", prompt=PROMPTS[3], max_tokens=12, stream=True)
    plain = server.client.completions.create(model="art", prompt=PROMPTS[3], max_tokens=12)
    assert "".join(c.choices[0].text for c in pieces) == plain.choices[0].text


def test_concurrent_requests_each_equal_their_answer_alone(server):
    alone = {p: _chat(server, p, 6 + i).model_extra["eectl"]["tokens"] for i, p in enumerate(PROMPTS)}
    got: dict[str, list[int]] = {}

    def ask(i: int, p: str) -> None:
        got[p] = _chat(server, p, 6 + i).model_extra["eectl"]["tokens"]

    # 6 clients on 4 slots and a queue of 2: every request is seated or waits, none refused
    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    before = server.health()["cancelled"]
    stream = _chat(server, PROMPTS[4], LONG, stream=True)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    doc = server.wait_until(lambda d: d["running"] == 0, "freed the slot")
    assert doc["cancelled"] == before + 1
    assert len(_chat(server, PROMPTS[4], 4).model_extra["eectl"]["tokens"]) == 4  # the server goes on


def test_bad_requests_are_400_naming_the_field(server):
    cases = [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 5000}, "max_tokens"),  # past the context
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ]
    for extra, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            args = {"max_tokens": 4, **extra}
            server.client.chat.completions.create(model="art", messages=[{"role": "user", "content": "hi"}], **args)
        assert err.value.status_code == 400
        assert err.value.body["param"] == field, (extra, err.value.body)
        assert err.value.body["type"] == "invalid_request_error" and err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(model="art", messages=[{"role": "robot", "content": "x"}])  # type: ignore[list-item]
    assert err.value.body["param"] == "messages.0"
    req = urllib.request.Request(server.url + "/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(req, timeout=10)
    assert bad.value.code == 400 and "not JSON" in json.loads(bad.value.read())["error"]["message"]


def test_a_full_queue_answers_429_with_the_openai_error_body(server):
    outcomes: list[str] = []

    def ask(p: str) -> None:
        try:
            for _ in _chat(server, p, LONG, stream=True):
                pass
            outcomes.append("done")
        except openai.RateLimitError as exc:
            assert exc.status_code == 429 and exc.body["type"] == "rate_limit_error"
            assert "wait already" in exc.body["message"]
            outcomes.append("429")

    threads = [threading.Thread(target=ask, args=(PROMPTS[i % len(PROMPTS)],)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 4 slots and a queue of 2: at most 6 of 10 clients at once are answered, the others refused at once
    assert outcomes.count("429") >= 1 and outcomes.count("done") >= 4 and len(outcomes) == 10
    assert server.health()["refused"] == outcomes.count("429")


def test_sigterm_drains_the_requests_in_flight_and_exits_0(artifact):
    s = Server(artifact, "--max-batch", "2")
    got: dict[str, object] = {}
    first = threading.Event()

    def ask() -> None:
        chunks = []
        for c in _chat(s, PROMPTS[0], 400, stream=True, stream_options={"include_usage": True}):
            chunks.append(c)
            first.set()
        got["usage"] = chunks[-1].usage

    t = threading.Thread(target=ask)
    t.start()
    try:
        assert first.wait(60)
        s.proc.send_signal(signal.SIGTERM)
        t.join(120)
        code, err = s.stop(signalled=True)
    finally:
        s.proc.kill()
    assert code == 0, err
    assert got["usage"].completion_tokens == 400  # type: ignore[attr-defined]  # drained: answered in full
    assert "stopped" in err and "Traceback" not in err
