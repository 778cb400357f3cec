"""`ggraph serve` as a client sees it: the official `openai` client against a real server process
on 127.0.0.1 serving the real SmolLM2 file on the CPU, checked against the library's own
generation (greedy, so the same text is expected token for token)."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

import ggraph

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

N_CTX = 512


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "stderr.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ggraph",
            "serve",
            "-m",
            smollm2,
            "--device",
            "cpu",
            "--port",
            str(port),
            "-c",
            str(N_CTX),
            "-t",
            "2",
            "--parallel",
            "4",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                assert json.load(r) == {"status": "ok"}
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                log.seek(0)
                pytest.fail(f"the server did not start: {log.read()}")
            time.sleep(0.3)
    proc.log = log
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(smollm2):
    """The library in this process, for the expected outputs (with `ggraph serve`'s default
    F16 cache)."""
    return ggraph.Model(smollm2, device="cpu", n_ctx=N_CTX, kv_type="f16")


def _chat_reference(local, content, max_tokens):
    local.reset()
    messages = [{"role": "user", "content": content}]
    return "".join(local.chat(messages, max_tokens=max_tokens, temperature=0)), local.stop_reason


def _ask(client, content, max_tokens):
    return client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )


def test_a_developer_message_is_a_system_message(client, local):
    """OpenAI's "developer" role reaches the chat template as "system"."""
    local.reset()
    system = [{"role": "system", "content": "Answer in French."}]
    user = [{"role": "user", "content": "What is the capital of Spain?"}]
    want = "".join(local.chat(system + user, max_tokens=12, temperature=0))
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "developer", "content": "Answer in French."}] + user,
        max_tokens=12,
        temperature=0,
    )
    assert r.choices[0].message.content == want


def test_lists_its_model(client, smollm2):
    ids = [m.id for m in client.models.list().data]
    assert ids == [os.path.basename(smollm2)]


def test_chat_equals_the_librarys_greedy_generation(client, local):
    want, reason = _chat_reference(local, "What is the capital of France?", 40)
    r = _ask(client, "What is the capital of France?", 40)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[reason]
    assert r.usage.completion_tokens == local.n_generated
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_ignore_eos_runs_a_request_past_its_end_of_generation_token(client, local):
    """ignore_eos (vLLM's and llama.cpp's extension) generates the end-of-generation token as
    any other: the answer runs to max_tokens, as the library's generate(ignore_eos=True) does."""
    question = "What is the capital of France?"
    ended, reason = _chat_reference(local, question, 60)
    assert reason == "eos"  # the plain answer ends on its own before 60 tokens
    local.reset()
    messages = [{"role": "user", "content": question}]
    want = "".join(local.chat(messages, max_tokens=60, temperature=0, ignore_eos=True))
    r = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=60,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.content == want and want.startswith(ended)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 60


def test_completion_with_logprobs_equals_the_library(client, local):
    prompt = "The three primary colours are"
    local.reset()
    steps = [
        s for s in local.generate(prompt, max_tokens=12, temperature=0, logprobs=3) if s.token >= 0
    ]
    r = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=12, temperature=0, logprobs=3
    )
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 12
    assert c.logprobs.token_logprobs == pytest.approx([s.logprob for s in steps], abs=1e-5)
    assert [len(t) for t in c.logprobs.top_logprobs] == [3] * 12
    assert "".join(c.logprobs.tokens) == local.detokenize([s.token for s in steps])


def test_text_offsets_hold_while_a_stop_string_holds_the_text(client, local):
    """A stop string that every step's text may begin (the whole completion and one character
    more) holds all the text back to the end: each token's text_offset is still where its text
    begins in the completion, streamed or not."""
    prompt = "The three primary colours are"
    local.reset()
    steps = local.generate(prompt, max_tokens=10, temperature=0, logprobs=1)
    tokens = [s.token for s in steps if s.token >= 0]
    text = local.detokenize(tokens)
    want = [len(local.detokenize(tokens[:i])) for i in range(len(tokens))]
    assert want[-1] > 0
    for stream in (False, True):
        r = client.completions.create(
            model="smollm2",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            logprobs=1,
            stop=[text + "\x00"],
            stream=stream,
        )
        chunks = list(r) if stream else [r]
        got = [
            o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
        ]
        assert "".join(c.choices[0].text for c in chunks) == text
        assert got == want, stream


def test_chat_logprobs_leave_out_the_end_of_generation_token(client, local):
    """A reply that ends at the end-of-generation token: its logprob entries are the reply's
    tokens, streamed or not, and none is the end token's."""
    want, reason = _chat_reference(local, "What is 2+2?", 40)
    assert reason == "eos"
    n_reply = local.n_generated - 1  # the end token is drawn, and counted in the usage
    end = "<|im_end|>"  # SmolLM2's end-of-generation token
    for stream in (False, True):
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=40,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=stream,
        )
        if stream:
            chunks = list(r)
            entries = [
                e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
            ]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            entries = r.choices[0].logprobs.content
            content = r.choices[0].message.content
            finish = r.choices[0].finish_reason
        assert finish == "stop" and content == want
        assert [e.token for e in entries if e.token == end] == []
        assert "".join(e.token for e in entries) == want
        assert len(entries) == n_reply


def test_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "Name three fruits."}]
    whole = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=30, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    plain = client.completions.create(model="smollm2", prompt="Once upon", max_tokens=10, seed=3)
    streamed = client.completions.create(
        model="smollm2", prompt="Once upon", max_tokens=10, seed=3, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


def test_eight_concurrent_streams_each_get_their_own_answer(client, local):
    questions = [f"What is {i} plus {i}?" for i in range(8)]
    want = []
    for q in questions:
        text, _ = _chat_reference(local, q, 16)
        want.append((text, local.n_generated))
    got = [None] * 8

    def run(i):
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": questions[i]}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got[i] = (text, chunks[-1].usage.completion_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == want


def test_a_conversations_next_turn_finds_its_history_in_a_session(client):
    """Turn one of a conversation, then another conversation, then the first's turn two: the
    second conversation takes another session (it shares only the template's first tokens with
    the first), so turn two finds its whole history cached, and usage reports it."""

    def ask(messages):
        return client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=6, temperature=0
        )

    first = [
        {"role": "system", "content": "You answer briefly. This conversation is about the sea."},
        {"role": "user", "content": "Name a fish that lives in cold water."},
    ]
    r1 = ask(first)
    r2 = ask(
        [
            {"role": "system", "content": "Keep it short. We talk about mountains and snow."},
            {"role": "user", "content": "Name a high peak."},
        ]
    )
    assert r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens // 2
    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And one from warm water?"},
    ]
    r3 = ask(second)
    cached = r3.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r3.usage.prompt_tokens


def test_bad_requests_get_openai_errors_and_the_server_goes_on(client, server):
    bad = [
        {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
        {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}], "n": 2},
        {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
        {"messages": [{"role": "user", "content": "hi"}], "seed": 2**63 + 5},
        {"messages": [{"role": "user", "content": "hi"}], "extra_body": {"top_k": 2**40}},
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 100}},
        {"messages": [{"role": "user", "content": "hi"}], "extra_body": {"ignore_eos": "yes"}},
        {"messages": [{"role": "tool", "content": "hi"}]},
        {"messages": [{"role": "narrator", "content": "hi"}]},
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"},
        },
        {"messages": [{"role": "user", "content": "word " * (N_CTX + 10)}]},
    ]
    for body in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smollm2", **body)
        assert e.value.status_code == 400
        assert e.value.body["type"] == "invalid_request_error", body
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt=[10**9])
    for extra in ({"echo": True}, {"suffix": "end"}, {"best_of": 3}):  # not ignored
        with pytest.raises(openai.BadRequestError, match=next(iter(extra))):
            client.completions.create(model="smollm2", prompt="Hello", max_tokens=2, **extra)
    # What asks for nothing, as clients send it, is taken.
    r = client.completions.create(
        model="smollm2", prompt="Hello", max_tokens=2, logit_bias={}, echo=False, best_of=1
    )
    assert r.usage.completion_tokens == 2
    # Lone surrogates, which JSON may escape but UTF-8 cannot hold, in a stop string and a
    # prompt: refused as bad requests.
    for data in (
        b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}',
        b'{"prompt": "a lone \\udc80 surrogate", "max_tokens": 2}',
    ):
        req = urllib.request.Request(server[1] + "/v1/completions", data=data, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        assert e.value.code == 400 and "UTF-8" in json.load(e.value)["error"]["message"]
    # A body past the server's bound: refused once its length is known, not read.
    from ggraph.server import MAX_BODY_BYTES

    host, port = urllib.parse.urlsplit(server[1]).netloc.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders(b'{"prompt": "aaaa')
    r = conn.getresponse()
    assert r.status == 413 and "larger than" in json.load(r)["error"]["message"]
    conn.close()
    for data in (b"{not json", b"[" * 5000 + b"]" * 5000):  # the second nests past recursion
        req = urllib.request.Request(server[1] + "/v1/completions", data=data, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        assert e.value.code == 400 and "error" in json.load(e.value)
    r = client.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0
    )
    assert r.usage.completion_tokens == 0 and r.choices[0].message.content == ""


def test_a_dropped_stream_is_cancelled_and_the_server_goes_on(client, local, server):
    stream = client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=400, temperature=1, seed=5,
        stream=True,
    )  # fmt: skip
    next(iter(stream))
    stream.close()
    want, _ = _chat_reference(local, "Say yes.", 8)
    assert _ask(client, "Say yes.", 8).choices[0].message.content == want
    # The dropped generation stopped early instead of running to its 400 tokens.
    server[0].log.seek(0)
    cancelled = [ln for ln in server[0].log.read().splitlines() if "was cancelled after" in ln]
    assert cancelled and int(cancelled[-1].split()[-2]) < 400


def test_sigterm_ends_the_requests_in_flight_and_stops_the_server_at_once(client, server):
    """Four streams run (the server's --parallel 4) and a fifth waits when SIGTERM comes: each
    ends with an error event saying the server shut down (the waiting one unstarted), not cut
    off and not as if its text were a whole answer, and the server stops within a second or two
    rather than after its graceful timeout, with nothing in its log but its stop."""
    proc, _ = server
    ended = {}

    def stream(i):
        try:
            s = client.completions.create(
                model="smollm2", prompt=f"Story number {i}:", max_tokens=400, temperature=1,
                seed=i, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            ended[i] = sum(1 for _ in s)  # a stream that ended as if it were done
        except openai.APIError as e:  # its error event (a stream cut off is another error)
            ended[i] = str(e)

    def whole(i):  # a request that is not a stream, waiting for a session
        try:
            client.with_options(max_retries=0).completions.create(
                model="smollm2", prompt=f"Story number {i}:", max_tokens=400, temperature=1,
                seed=i, extra_body={"ignore_eos": True},
            )  # fmt: skip
            ended[i] = "answered"
        except openai.APIStatusError as e:
            ended[i] = f"{e.status_code} {e}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(5)]
    threads.append(threading.Thread(target=whole, args=(5,)))
    for t in threads:
        t.start()
    time.sleep(1.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    # The server shuts down (its engine stopped), then ends as SIGTERM's default would.
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    stopped_in = time.monotonic() - t0
    for t in threads:
        t.join(timeout=30)
    assert len(ended) == 6, ended
    assert all(isinstance(m, str) and "shutting down" in m for m in ended.values()), ended
    assert ended[5].startswith("503"), ended
    assert stopped_in < 4, stopped_in
    proc.log.seek(0)
    log = proc.log.read()
    assert "ggraph serve: stopped" in log and "Traceback" not in log, log


def _run_engine(path, prompts, max_tokens, n_ctx, sampling=None, cached=None, **engine):
    """Runs greedy jobs of `prompts` through an Engine over a model of engine['parallel']
    sequences; returns each job's (text, done event), and every event's (job, kind) in the
    order the engine sent them. cached (a list): gets each job's cached prompt tokens."""
    import asyncio

    from ggraph.server import Engine, _Job

    order = []

    class Recorded(_Job):
        def deliver(self, event):
            order.append((self.index, event[0]))
            super().deliver(event)

    async def run():
        model = ggraph.Model(
            path, device="cpu", n_ctx=n_ctx, n_threads=1, n_seq_max=engine["parallel"]
        )
        eng = Engine(model, **engine)
        loop = asyncio.get_running_loop()
        jobs = []
        for i, p in enumerate(prompts):
            job_sampling = {"temperature": 0.0} if sampling is None else sampling(i)
            job = Recorded(loop, p, max_tokens, [], None, job_sampling, ignore_eos=True)
            job.index = i
            jobs.append(job)
            eng.submit(job)
        out = []
        for job in jobs:
            pieces = []
            while True:
                kind, value = await job.events.get()
                if kind == "token":
                    pieces.append(value[0])
                elif kind == "done":
                    out.append(("".join(pieces), value))
                    if cached is not None:
                        cached.append(job.cached)
                    break
                else:
                    raise value
        eng.close()
        return out

    return asyncio.run(run()), order


def _alone_texts(path, prompts, max_tokens, n_ctx, sampling=None):
    out = []
    for i, p in enumerate(prompts):
        alone = ggraph.Model(path, device="cpu", n_ctx=n_ctx, n_threads=1)
        params = sampling(i) if sampling is not None else {"temperature": 0}
        steps = alone.generate(p, max_tokens=max_tokens, ignore_eos=True, **params)
        out.append("".join(steps))
    return out


def test_the_engine_runs_jobs_in_turns_on_sessions(tiny_model):
    """Five jobs on three sequences: the first three start at once and advance a step each in
    turn, the others take the sequences that free up, and every job's text is the one a model of
    its own generates."""
    prompts = [[5, 17, 42], [200, 11], [7, 8, 9, 10], [99], [3, 61, 27, 14]]
    results, order = _run_engine(tiny_model, prompts, 12, 64, parallel=3)
    assert [text for text, _ in results] == _alone_texts(tiny_model, prompts, 12, 64)
    assert all(done[1] == 12 for _, done in results)
    first_done = order.index((0, "done"))
    assert (1, "token") in order[:first_done] and (2, "token") in order[:first_done]
    assert order.index((3, "token")) > min(order.index((i, "done")) for i in range(3))


def test_jobs_that_start_alike_share_the_first_ones_prompt(tiny_model):
    """Three jobs at once whose prompts share 40 tokens: the second and third wait for the
    first's prompt to go in, then copy its cache's shared rows instead of evaluating them, and
    each text is still the one a model of its own generates. Without sharing, nothing is
    cached."""
    shared = [(7 * i + 3) % 250 + 1 for i in range(40)]
    prompts = [shared + [11, 12], shared + [200, 3, 4], shared + [99]]
    alone = _alone_texts(tiny_model, prompts, 10, 96)
    for share, want in ((True, [0, 40, 40]), (False, [0, 0, 0])):
        cached = []
        results, _ = _run_engine(
            tiny_model, prompts, 10, 96, cached=cached, parallel=3, share_prefixes=share
        )
        assert [text for text, _ in results] == alone
        assert cached == want, share


def test_a_held_job_keeps_a_sequence_from_later_jobs(tiny_model):
    """Two sequences: the second job waits for the first's shared prompt, and the third (nothing
    shared) may not take the sequence the second waits for: the second's tokens come before the
    third's, which starts once a sequence frees up."""
    shared = [(5 * i + 2) % 250 + 1 for i in range(40)]
    prompts = [shared + [11, 12], shared + [200, 3], [17, 18, 19]]
    cached = []
    results, order = _run_engine(tiny_model, prompts, 8, 96, cached=cached, parallel=2)
    assert [text for text, _ in results] == _alone_texts(tiny_model, prompts, 8, 96)
    assert cached[:2] == [0, 40]
    assert order.index((1, "token")) < order.index((2, "token"))
    assert order.index((2, "token")) > min(order.index((i, "done")) for i in range(2))


def test_the_engines_jobs_sample_as_generations_of_their_own(tiny_model):
    """Sampled jobs (each its seed and settings, and penalties over its own history), whose tokens
    a batched step presamples on several threads: each text is the one a model of its own
    generates with the same seed."""
    prompts = [[5, 17, 42], [200, 11], [7, 8, 9, 10], [99], [3, 61, 27, 14]]

    def sampling(i):
        return {
            "temperature": 0.7 + 0.1 * i,
            "top_k": [0, 40, 0, 5, 0][i],
            "top_p": [1.0, 0.9, 0.8, 1.0, 1.0][i],
            "frequency_penalty": [0.8, 0.5, 1.0, 0.6, 0.9][i],
            "presence_penalty": [0.5, 0.0, 0.3, 0.7, 0.0][i],
            "seed": 1000 + i,
        }

    results, _ = _run_engine(tiny_model, prompts, 16, 64, sampling=sampling, parallel=3)
    expected = _alone_texts(tiny_model, prompts, 16, 64, sampling=sampling)
    assert [text for text, _ in results] == expected
    assert len(set(expected)) == len(expected)


def test_a_long_prompt_goes_in_by_chunks_while_another_job_streams(tiny_model):
    """Chunked prefill: a job whose prompt takes several steps to go in does not hold back the
    job already running, and both texts are those of models of their own."""
    prompts = [[5, 17, 42], [(7 * i + 3) % 300 + 5 for i in range(100)]]
    # The long prompt goes in 8 tokens a step: 13 steps.
    results, order = _run_engine(tiny_model, prompts, 24, 160, parallel=2, prefill_chunk=8)
    assert [text for text, _ in results] == _alone_texts(tiny_model, prompts, 24, 160)
    # The short job streamed on while the long prompt went in: several of its tokens came
    # before the long job's first.
    first_long = order.index((1, "token"))
    assert order[:first_long].count((0, "token")) >= 8


def test_engines_share_prefixes_unless_told_not_to_or_one_sequence(tiny_model):
    """Sharing is on by default on every device with several sequences, and off when asked,
    with one sequence, or over sliding-window rings (`ggraph serve --no-share-prefixes` passes
    False)."""
    from ggraph.cli import build_parser
    from ggraph.server import Engine

    assert build_parser().parse_args(["serve"]).share_prefixes is None
    assert build_parser().parse_args(["serve", "--no-share-prefixes"]).share_prefixes is False
    model = ggraph.Model(tiny_model, device="cpu", n_ctx=32, n_threads=1, n_seq_max=3)
    for parallel, share, want in ((2, None, True), (2, False, False), (1, None, False)):
        eng = Engine(model, parallel, share_prefixes=share)
        assert eng.share_prefixes is want, (parallel, share)
        eng.close()


def test_logprobs_of_tokens_that_hold_part_of_a_character(local):
    """A token that holds part of a UTF-8 character: its chat logprob's bytes are its own (all
    of them together spell the text), and its legacy token string is its bytes as OpenAI
    writes them, so that alternatives of different bytes keep different keys."""
    import types

    from ggraph.server import _chat_logprob, _completion_logprobs

    text = "🎉 ok"
    ids = local.tokenize(text, add_bos=False)
    steps = [types.SimpleNamespace(token=t, logprob=-0.5, top=[(t, -0.5)]) for t in ids]
    entries = [_chat_logprob(local, s) for s in steps]
    assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()
    partial = [e for e in entries if e["token"].startswith("bytes:")]
    assert partial and all("\ufffd" not in e["token"] for e in entries)
    assert partial[0]["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in partial[0]["bytes"])
    legacy = _completion_logprobs(local, steps, [0, 0, 0, 1, 2][: len(steps)])
    assert legacy["tokens"] == [e["token"] for e in entries]
    assert [list(d) for d in legacy["top_logprobs"]] == [[e["token"]] for e in entries]
