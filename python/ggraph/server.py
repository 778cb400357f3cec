"""`ggraph serve`: an OpenAI-compatible HTTP server over one model (starlette + uvicorn).

    ggraph serve [-m MODEL] [--host 127.0.0.1] [--port 8080] [--device auto] [-c N_CTX]
                 [--parallel N] [--no-share-prefixes]

Endpoints: GET /health, GET /v1/models, POST /v1/completions and POST /v1/chat/completions (with
"stream": true as server-sent events). The HTTP layer parses, streams and formats; the engine
thread owns the model and runs up to N generations at once, each on a session of its own (a KV
cache of n_ctx tokens each), a step of each in turn; more requests wait in arrival order for a
free one. A request takes the free session whose cache holds the longest prefix of its prompt (a
conversation's earlier turns, a shared system prompt) where that is half of it or more, else the
least recently used one; its usage reports the prefix it found as
prompt_tokens_details.cached_tokens. A longer prefix in another session's cache is copied over
(Engine.share_prefixes; --no-share-prefixes turns it off). A stream whose client goes away is
cancelled at its next token. Malformed requests get a 400 in OpenAI's error shape, and the server
goes on serving. At shutdown (SIGINT, SIGTERM) the requests in flight and waiting end with a 503,
or a stream with an error event, that says so: a cut-off text is never given as an answer.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import queue
import sys
import threading
import time
import uuid

import numpy as np

from ggraph import _core
from ggraph.model import GeneratedToken

# The sampling defaults of a request that names none (OpenAI's, but for top_k and min_p, which
# its API lacks: off).
_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# The GIL switch interval while serving, in seconds (see serve()).
_SWITCH_INTERVAL = 0.0005
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context_full": "length"}
# The largest request body read (a 413 past it): far more text than any context holds.
MAX_BODY_BYTES = 32 << 20


def _shutdown_message(n_completion: int) -> str:
    """What a client whose request the server's shutdown cancelled is told (a request whose
    client left is cancelled too, with nobody to tell)."""
    return (
        "the server is shutting down: the request was cancelled after "
        f"{n_completion} generated tokens"
    )


class RequestError(ValueError):
    """A request the server refuses: becomes a 400 in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _error_body(message, kind="invalid_request_error", param=None, code=None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Job:
    """One request's generation: its arguments, its events and whether its client left."""

    def __init__(self, loop, ids, max_tokens, stop, logprobs, sampling, ignore_eos=False):
        self.loop, self.ids, self.max_tokens = loop, ids, max_tokens
        self.stop, self.logprobs, self.sampling = stop, logprobs, sampling
        self.ignore_eos = ignore_eos
        self.cached = 0  # prompt tokens its sequence's cache held already (set before "done")
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, event) -> None:
        """Sends an event from another thread."""
        self.loop.call_soon_threadsafe(self.deliver, event)

    def deliver(self, event) -> None:
        """Queues an event, on the job's event loop."""
        self.events.put_nowait(event)


def _deliver(events) -> None:
    """Delivers (job, event) pairs, in order, on the jobs' event loop."""
    for job, event in events:
        job.deliver(event)


class Engine:
    """The thread that owns the model: up to `parallel` generations at once, each on a sequence
    of its own (the model, then its sessions). Each step evaluates every one's last token in one
    batched decode and samples their next ones, in one call that leaves the GIL to the event
    loop (_core.step_batch), so that a request starts as soon as a sequence is free and the
    weights are read once a step for all of them. A job gets ("token", (text, step)), step the
    GeneratedToken of a sampled token when the job asked for logprobs (else None), then
    ("done", (stop_reason, n_generated)) or ("error", exception). What a job reports comes with
    its events: a sequence's own fields belong to its next job by the time the event loop
    reads them."""

    # Prompt tokens that another sequence's cache must hold beyond a job's own to be copied
    # over rather than evaluated again (share_prefixes).
    SHARE_MIN = 32

    def __init__(
        self, model, parallel: int = 1, prefill_chunk: int = 32, share_prefixes: bool | None = None
    ):
        self.model = model
        # A new request's prompt goes in this many tokens a step, between the others' tokens
        # (chunked prefill), when others may be running.
        self.prefill_chunk = prefill_chunk if parallel > 1 else 0
        # A prompt's prefix that another sequence's cache holds is copied (copy_prefix: its
        # rows alone, on the device) instead of evaluated again, and a job whose prompt starts
        # as a running one's still going in waits for it. On by default (BENCHMARKS: the CPU
        # and CUDA servers). Never with sliding-window rings, which keep other positions than
        # a prefix.
        rings = any(k.endswith(".attention.sliding_window") for k in model.metadata)
        share = True if share_prefixes is None else share_prefixes
        self.share_prefixes = share and parallel > 1 and not rings
        self._tokens: dict = {}  # id(sequence) -> its cache's tokens, read once a pass
        self._free = [model] + [model.session() for _ in range(parallel - 1)]
        self._jobs: queue.Queue = queue.Queue()
        # Set at shutdown (close, or the server's signal): running jobs end at their next token
        # and waiting ones never start. A plain attribute, which a signal handler may set.
        self.stopping = False
        self._lock = threading.Lock()
        self._running: dict = {}  # job -> its sequence, while it runs
        # A step's events, handed to the event loop together (one wake-up a step, not a token).
        self._outbox: list = []
        self._thread = threading.Thread(target=self._run, name="ggraph-engine", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        self._jobs.put(job)

    def cancel(self, job: _Job) -> None:
        job.cancelled.set()
        with self._lock:
            seq = self._running.get(job)
            if seq is not None:
                seq.cancel()  # also stops a long prompt between its chunks

    def close(self) -> None:
        self.stopping = True
        with self._lock:
            for job, seq in self._running.items():
                job.cancelled.set()
                seq.cancel()
        self._jobs.put(None)
        self._thread.join()

    def _start(self, job: _Job, seq):
        with self._lock:
            self._running[job] = seq
        gen, epoch = seq._begin(
            job.ids,
            job.max_tokens,
            job.stop,
            job.logprobs,
            ignore_eos=job.ignore_eos,
            prefill_chunk=self.prefill_chunk,
            **job.sampling,
        )
        if job.cancelled.is_set():  # a cancel the generation's start cleared
            seq.cancel()
        return gen, epoch

    def _step(self, active) -> list:
        """One engine step, in one call with the model held (_core.step_batch): the tokens the
        running jobs' last steps sampled are evaluated together and the next ones sampled, then
        every job advances by one token (its text may be held back). Returns the entries that
        have finished."""
        finished, live = [], []
        for entry in active:
            job, seq, _, epoch = entry
            if job.cancelled.is_set():
                print(
                    f"ggraph serve: a request was cancelled after {seq.n_generated} tokens",
                    file=sys.stderr,
                    flush=True,
                )
                self._post(job, ("done", ("cancelled", seq.n_generated)))
                finished.append(entry)
            elif seq._epoch != epoch:  # the sequence changed under the generation
                self._post(
                    job, ("error", RuntimeError("generate: this generator is no longer valid"))
                )
                finished.append(entry)
            else:
                live.append(entry)
        if not live:
            return finished
        with self.model._lock.base:
            steps, failed = _core.step_batch(self.model._ctx, [gen for _, _, gen, _ in live])
        if failed is not None:  # the batch's decode: every job in it fails
            for entry in live:
                self._post(entry[0], ("error", failed))
            return finished + live
        for entry, (step, n_generated, stop_reason) in zip(live, steps):
            job, seq = entry[0], entry[1]
            seq.n_generated, seq.stop_reason = n_generated, stop_reason
            job.cached = entry[2].cached_tokens
            if isinstance(step, BaseException):  # the request's failure, not the server's
                self._post(job, ("error", step))
                finished.append(entry)
            elif step is None:
                self._post(job, ("done", (stop_reason, n_generated)))
                finished.append(entry)
            else:
                text, token, logprob, top = step
                # The end-of-generation token is not part of the completion: it gets no
                # logprob entry (OpenAI's API gives it none), only the text it releases.
                if job.logprobs is None or stop_reason == "eos":
                    if text:
                        self._post(job, ("token", (text, None)))
                elif token >= 0 or text:
                    detail = GeneratedToken(token, text, logprob if token >= 0 else None, top)
                    self._post(job, ("token", (text, detail if token >= 0 else None)))
        return finished

    def _post(self, job: _Job, event) -> None:
        self._outbox.append((job, event))

    def _flush(self) -> None:
        """Hands the posted events to their event loops, one call per loop."""
        by_loop: dict = {}
        for job, event in self._outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._outbox = []
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_deliver, events)

    def _run(self) -> None:
        active = []  # [job, its sequence, its generator]
        held = []  # jobs waiting for a running job's prompt that starts as theirs (_awaits)
        closing = False
        while True:
            self._tokens = {}  # the sequences' caches may have moved since the last pass
            if self.stopping:
                closing = self._stop(active, held) or closing
                held = []
                if not active:
                    if closing:
                        return
                    job = self._jobs.get()  # close()'s sentinel, or a request that came late
                    if job is None:
                        return
                    job.emit(("done", ("cancelled", 0)))
                    continue
            for job in [j for j in held if j.cancelled.is_set()]:
                held.remove(job)
                job.emit(("done", ("cancelled", 0)))
            # New jobs while a sequence is free (held ones first, in arrival order); wait for
            # one only when nothing runs. A free sequence stays for each held job, which waits
            # a few steps only.
            while self._free and not closing and not self.stopping:
                job = next((j for j in held if not self._awaits(j, active)), None)
                if job is not None:
                    held.remove(job)
                elif len(self._free) <= len(held):
                    break
                else:
                    try:
                        job = self._jobs.get(block=not active)
                    except queue.Empty:
                        break
                    if job is None:
                        closing = True
                        break
                    if self._awaits(job, active):
                        held.append(job)
                        continue
                if job.cancelled.is_set():  # its client left while it waited
                    job.emit(("done", ("cancelled", 0)))
                    continue
                try:
                    seq = self._take_free(job.ids)
                except Exception as e:  # (reading the caches' tokens)
                    job.emit(("error", e))
                    continue
                try:
                    self._share_prefix(job, seq, active)
                    active.append([job, seq, *self._start(job, seq)])
                except Exception as e:
                    job.emit(("error", e))
                    self._finish(job, seq)
            if closing:
                for job in held:
                    job.emit(("done", ("cancelled", 0)))
                held = []
                if not active:
                    return
            for entry in self._step(active):
                active.remove(entry)
                self._finish(entry[0], entry[1])
            self._flush()

    def _stop(self, active, held) -> bool:
        """At shutdown: cancels the running jobs (they end at their next token) and ends the
        held and queued ones unstarted; whether close()'s sentinel came among them."""
        for job, seq, *_ in active:
            if not job.cancelled.is_set():
                job.cancelled.set()
                seq.cancel()
        closing = False
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                closing = True
                break
            held.append(job)
        for job in held:
            job.emit(("done", ("cancelled", 0)))
        return closing

    def _take_free(self, ids):
        """The free sequence to run prompt ids on: the one whose cache holds the longest prefix
        of it (a conversation's earlier turns, a shared system prompt) where that is at least
        half the prompt, so that the least of it is evaluated again; otherwise, and among
        equals, the one freed longest ago (least recently used), whose cache is the least likely
        to be asked for again: a new conversation does not push out another's history for a few
        shared tokens."""
        want = np.asarray(ids, dtype=np.int64)
        best, best_len = 0, -1
        for i, seq in enumerate(self._free):  # freed longest ago first
            common = self._common(seq, want)
            if common > best_len:
                best, best_len = i, common
        return self._free.pop(best if 2 * best_len >= len(want) else 0)

    def _held(self, seq) -> np.ndarray:
        """The tokens seq's cache holds, read once a pass of the engine's loop."""
        have = self._tokens.get(id(seq))
        if have is None:
            have = self._tokens[id(seq)] = np.asarray(seq._tokens, dtype=np.int64)
        return have

    def _common(self, seq_or_ids, want) -> int:
        """The length of the prefix that a sequence's cache (or a list of ids) shares with want
        (an array)."""
        if hasattr(seq_or_ids, "_tokens"):
            have = self._held(seq_or_ids)
        else:
            have = np.asarray(seq_or_ids, dtype=np.int64)
        n = min(len(have), len(want))
        differ = np.flatnonzero(have[:n] != want[:n])
        return int(differ[0]) if len(differ) else n

    def _awaits(self, job: _Job, active) -> bool:
        """Whether a running job's prompt, still going in, shares at least SHARE_MIN tokens with
        job's, more than any sequence's cache holds: job then waits for it (share_prefixes), to
        copy that prefix rather than evaluate it alongside. The wait lasts a step for each
        prefill_chunk tokens of it at most."""
        if not self.share_prefixes or not active:
            return False
        want = np.asarray(job.ids, dtype=np.int64)
        own = max((self._common(seq, want) for seq in self._free), default=0)
        have = max([own] + [self._common(e[1], want) for e in active])
        # (A running job whose cache held its share would make `have` as large.) Waits only
        # where _share_prefix would then copy: SHARE_MIN tokens past a free sequence's own.
        for e in active:
            shared = self._common(e[0].ids, want)
            if shared > have and shared >= own + self.SHARE_MIN:
                return True
        return False

    def _share_prefix(self, job: _Job, seq, active) -> None:
        """Copies into seq the cache of the sequence (free or running) that holds the longest
        prefix of job's prompt, where that is SHARE_MIN tokens more than seq's own (whose rows
        it replaces), and keeps that prefix (share_prefixes)."""
        if not self.share_prefixes:
            return
        want = np.asarray(job.ids, dtype=np.int64)
        own = self._common(seq, want)
        best, best_len = None, own + self.SHARE_MIN - 1
        for other in self._free + [e[1] for e in active]:
            n = self._common(other, want)
            if n > best_len:
                best, best_len = other, n
        if best is None:
            return
        self._tokens.pop(id(seq), None)
        try:
            seq.copy_prefix(best, best_len)
        except Exception:  # noqa: BLE001
            pass  # an optimization only: the prompt goes in as it is

    def _finish(self, job: _Job, seq) -> None:
        with self._lock:
            self._running.pop(job, None)
        self._free.append(seq)


# ---- Requests ----------------------------------------------------------------------------------


def _get(body, key, kinds, default=None, check=None, what=""):
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise RequestError(f"'{key}' must be {what}, got {value!r}", key)
    if not isinstance(value, kinds):
        raise RequestError(f"'{key}' must be {what}, got {value!r}", key)
    if check is not None and not check(value):
        raise RequestError(f"'{key}' must be {what}, got {value!r}", key)
    return value


def _sampling(body) -> dict:
    def number(key, default, check, bounds):  # an int or a float, as a float
        return float(_get(body, key, (int, float), default, check, "a number " + bounds))

    d = _DEFAULTS
    s = {
        "temperature": number("temperature", d["temperature"], lambda v: v >= 0, ">= 0"),
        "top_p": number("top_p", d["top_p"], lambda v: 0 < v <= 1, "in (0, 1]"),
        "top_k": _get(body, "top_k", int, d["top_k"], lambda v: 0 <= v < 2**31, "an int >= 0"),
        "min_p": number("min_p", d["min_p"], lambda v: 0 <= v <= 1, "in [0, 1]"),
        "frequency_penalty": number("frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        "presence_penalty": number("presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    }
    seed = _get(body, "seed", int, None, lambda v: 0 <= v < 2**63, "an int in [0, 2^63)")
    if seed is not None:
        s["seed"] = seed
    return s


def _stop(body) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > 4:
        raise RequestError(f"'stop' takes at most 4 strings, got {len(stops)}", "stop")
    return stops


# Parameters of OpenAI's API that this server does not implement, with the values that ask for
# nothing (which clients often send): any other value is refused rather than ignored.
_UNSUPPORTED = {
    "logit_bias": lambda v: v in (None, {}),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
}


def _common(body, model, ids, default_max):
    for key, asks_nothing in _UNSUPPORTED.items():
        if key in body and not asks_nothing(body[key]):
            raise RequestError(f"'{key}' is not supported by this server, got {body[key]!r}", key)
    if _get(body, "n", int, 1, what="1") != 1:
        raise RequestError("'n' must be 1: one choice a request", "n")
    room = model.n_ctx - len(ids)
    if room < 1:
        raise RequestError(
            f"the prompt is {len(ids)} tokens; the context holds {model.n_ctx}",
            "messages" if "messages" in body else "prompt",
            "context_length_exceeded",
        )
    max_tokens = _get(body, "max_completion_tokens", int, None, lambda v: v >= 0, "an int >= 0")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None, lambda v: v >= 0, "an int >= 0")
    max_tokens = min(room, default_max if max_tokens is None else max_tokens)
    return max_tokens, _stop(body), _sampling(body)


def _completion_request(body, model):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = model.tokenize(prompt)
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < model.n_vocab for t in prompt):
            raise RequestError(f"'prompt' holds a token id outside [0, {model.n_vocab})", "prompt")
        ids = list(prompt)
    else:
        raise RequestError(
            "'prompt' must be a string or a list of token ids (one prompt)", "prompt"
        )
    if not ids:
        raise RequestError("'prompt' is empty", "prompt")
    logprobs = _get(body, "logprobs", int, None, lambda v: 0 <= v <= 5, "an int in [0, 5]")
    return ids, logprobs, _common(body, model, ids, 16)


# The roles a chat message may have, as the chat template sees them: a "developer" message
# (OpenAI's newer name for the system's instructions) is a system message.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _chat_request(body, model):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    flat = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError("each message needs a 'role' and a 'content'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError("only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise RequestError("each message needs a 'role' and a 'content'", "messages")
        role = _ROLES.get(m["role"])
        if role is None:
            raise RequestError(
                f"a message's role must be one of {', '.join(_ROLES)}, got {m['role']!r}",
                "messages",
            )
        flat.append({"role": role, "content": content})
    ids = model.apply_chat_template(flat, tokenize=True)
    logprobs = None
    if _get(body, "logprobs", bool, False, what="a boolean"):
        logprobs = _get(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20, "an int in [0, 20]")
    return ids, logprobs, _common(body, model, ids, model.n_ctx)


# ---- Responses ---------------------------------------------------------------------------------


def _piece_text(piece: bytes) -> str:
    """A token's text, or for a token that holds part of a UTF-8 character, its bytes written
    as OpenAI writes them ("bytes:\\xe2\\x80")."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def _token_text(model, token: int) -> str:
    return _piece_text(model._ctx.token_to_piece(token))


class _TextOffsets:
    """Where each generated token's text begins in the completion's text, for the legacy
    logprobs' text_offset: the characters its tokens before it spell (a token that ends part of
    a UTF-8 character adds nothing until the token that completes it). Counted from the tokens,
    not from the text sent so far, which lags while a possible stop string is held back."""

    def __init__(self, model):
        self._model = model
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def next(self, token: int) -> int:
        at = self._chars
        self._chars += len(self._decoder.decode(self._model._ctx.token_to_piece(token)))
        return at


def _chat_logprob(model, step):
    def entry(token, logprob):
        piece = model._ctx.token_to_piece(token)
        return {"token": _piece_text(piece), "logprob": logprob, "bytes": list(piece)}

    item = entry(step.token, step.logprob)
    item["top_logprobs"] = [entry(t, lp) for t, lp in step.top]
    return item


def create_app(model, model_name: str, parallel: int = 1, share_prefixes: bool | None = None):
    """The starlette application serving `model` (a ggraph.Model) as `model_name`, running up to
    `parallel` requests at once (the model must hold that many sequences: n_seq_max).
    share_prefixes: copy a prompt's prefix from another sequence's cache (Engine); None: on."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    engine = Engine(model, parallel, share_prefixes=share_prefixes)
    created = int(time.time())

    def error(status, message, kind="invalid_request_error", param=None, code=None):
        return JSONResponse(_error_body(message, kind, param, code), status_code=status)

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def models(request: Request):
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": model_name, "object": "model", "created": created, "owned_by": "ggraph"}
                ],
            }
        )

    async def events(job: _Job):
        """The job's events until it ends; cancels it if the consumer stops early."""
        engine.submit(job)
        finished = False
        try:
            while True:
                kind, value = await job.events.get()
                finished = kind != "token"
                if kind == "error":
                    raise value
                yield kind, value
                if kind == "done":
                    return
        finally:
            if not finished:
                engine.cancel(job)

    def usage(job: _Job, n_completion: int) -> dict:
        n_prompt = len(job.ids)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion,
            # The prompt's prefix that its sequence's cache held already, as OpenAI reports it.
            "prompt_tokens_details": {"cached_tokens": job.cached},
        }

    async def read_body(request: Request) -> bytes | None:
        """The request's body, or None past MAX_BODY_BYTES (read no further)."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return None
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                return None
            parts.append(part)
        return b"".join(parts)

    async def handle(request: Request, chat: bool):
        try:
            raw = await read_body(request)
            if raw is None:
                return error(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            body = json.loads(raw)
        except ClientDisconnect:  # it left before its request arrived: nobody to answer
            return Response(status_code=400)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        try:
            # Tokenizing and template rendering may take a while: off the event loop.
            ids, logprobs, (max_tokens, stop, sampling) = await run_in_threadpool(
                _chat_request if chat else _completion_request, body, model
            )
            _core.validate_sampling(**sampling)
            stream = _get(body, "stream", bool, False, what="a boolean")
            # An end-of-generation token generated as any other (vLLM's and llama.cpp's
            # extension): a request then runs to max_tokens or a stop string.
            ignore_eos = _get(body, "ignore_eos", bool, False, what="a boolean")
            opts = body.get("stream_options") or {}
            include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        except RequestError as e:
            return error(400, str(e), param=e.param, code=e.code)
        except (ValueError, TypeError, OverflowError) as e:  # a template's, the sampler's
            return error(400, str(e))
        job = _Job(
            asyncio.get_running_loop(), ids, max_tokens, stop, logprobs, sampling, ignore_eos
        )
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"

        if not stream:
            texts, steps, offsets, finish, n_completion, reason = [], [], [], None, 0, None
            offsets_of = _TextOffsets(model)

            async def watch():  # a client that leaves cancels its generation
                while not await request.is_disconnected():
                    await asyncio.sleep(0.25)
                engine.cancel(job)

            watcher = asyncio.create_task(watch())
            try:
                async for kind, value in events(job):
                    if kind == "token":
                        if value[1] is not None:
                            steps.append(value[1])
                            if not chat:  # the legacy logprobs' text_offset
                                offsets.append(offsets_of.next(value[1].token))
                        texts.append(value[0])
                    else:
                        reason, n_completion = value
                        finish = _FINISH.get(reason, "stop")
            except ValueError as e:  # refused by the core (the context)
                return error(400, str(e))
            except Exception as e:
                return error(500, f"{type(e).__name__}: {e}", kind="server_error")
            finally:
                watcher.cancel()
            if reason == "cancelled":  # not an answer: a cut-off or unstarted one
                return error(503, _shutdown_message(n_completion), kind="server_error")
            text = "".join(texts)
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": [_chat_logprob(model, s) for s in steps]}
                    if logprobs is not None
                    else None,
                    "finish_reason": finish,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": _completion_logprobs(model, steps, offsets)
                    if logprobs is not None
                    else None,
                    "finish_reason": finish,
                }
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": int(time.time()),
                    "model": model_name,
                    "choices": [choice],
                    "usage": usage(job, n_completion),
                }
            )

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice=None, **extra):
            c = {
                "id": rid,
                "object": chunk_obj,
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice] if choice is not None else [],
            }
            c.update(extra)
            return f"data: {json.dumps(c)}\n\n"

        async def sse():
            offsets_of = _TextOffsets(model)
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}})
            try:
                async for kind, value in events(job):
                    if kind == "token":
                        text, step = value
                        lp = None
                        if step is not None and chat:
                            lp = {"content": [_chat_logprob(model, step)]}
                        elif step is not None:
                            lp = _completion_logprobs(model, [step], [offsets_of.next(step.token)])
                        if not text and lp is None:
                            continue
                        if chat:
                            yield chunk(
                                {
                                    "index": 0,
                                    "delta": {"content": text},
                                    "logprobs": lp,
                                    "finish_reason": None,
                                }
                            )
                        else:
                            yield chunk(
                                {"index": 0, "text": text, "logprobs": lp, "finish_reason": None}
                            )
                    else:
                        reason, n_completion = value
                        if reason == "cancelled":  # the text so far is not a whole answer
                            body = _error_body(_shutdown_message(n_completion), kind="server_error")
                            yield f"data: {json.dumps(body)}\n\n"
                            break
                        finish = _FINISH.get(reason, "stop")
                        if chat:
                            yield chunk({"index": 0, "delta": {}, "finish_reason": finish})
                        else:
                            yield chunk({"index": 0, "text": "", "finish_reason": finish})
                        if include_usage:
                            yield chunk(None, usage=usage(job, n_completion))
            except ValueError as e:
                yield f"data: {json.dumps(_error_body(str(e)))}\n\n"
            except Exception as e:  # the stream has begun: the error goes in it
                body = _error_body(f"{type(e).__name__}: {e}", kind="server_error")
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        async def coalesced():
            # Events that arrived together go out in one write: under load the event loop
            # then does its per-write work once for several tokens, not once a token.
            parts = []
            async for part in sse():
                parts.append(part)
                if job.events.empty():
                    yield "".join(parts)
                    parts.clear()
            if parts:
                yield "".join(parts)

        return StreamingResponse(coalesced(), media_type="text/event-stream")

    async def completions(request: Request):
        return await handle(request, chat=False)

    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def not_found(request: Request, exc):
        return error(404, f"no route {request.method} {request.url.path}", code="not_found")

    async def not_allowed(request: Request, exc):
        return error(405, f"{request.method} is not allowed on {request.url.path}")

    async def failed(request: Request, exc):
        return error(500, f"{type(exc).__name__}: {exc}", kind="server_error")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # Off the event loop, which delivers the cancelled jobs' last events meanwhile.
        await asyncio.to_thread(engine.close)
        print("ggraph serve: stopped", file=sys.stderr, flush=True)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={404: not_found, 405: not_allowed, Exception: failed},
        lifespan=lifespan,
    )
    app.state.engine = engine
    return app


def _completion_logprobs(model, steps, offsets) -> dict:
    """The legacy completions' logprobs object for the generated tokens, each at its offset of
    the completion's text (_TextOffsets)."""
    return {
        "tokens": [_token_text(model, s.token) for s in steps],
        "token_logprobs": [s.logprob for s in steps],
        "top_logprobs": [{_token_text(model, t): lp for t, lp in s.top} for s in steps],
        "text_offset": list(offsets),
    }


def serve(
    model,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    parallel: int = 1,
    share_prefixes: bool | None = None,
) -> None:
    """Serves until SIGINT or SIGTERM; a request in flight is cancelled at its next token."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError(
            'ggraph serve needs starlette and uvicorn: pip install "ggraph-llm[serve]"'
        ) from None
    app = create_app(model, model_name, parallel, share_prefixes)
    # The engine thread wants the GIL back after each step; with Python's default switch
    # interval (5 ms) the event loop's thread, busy with the streams, may keep it that long
    # while the GPU waits for the next step.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, _SWITCH_INTERVAL))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.engine.stopping = True  # what runs ends at its next token
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5
    )
    try:
        Server(config).run()
    finally:
        sys.setswitchinterval(interval)
