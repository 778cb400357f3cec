"""The ggraph command: generate, chat, info, bench."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _int_in(lo, hi):
    """An argparse type: an integer from lo to hi (a usage error, not a traceback, otherwise)."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {lo} to {hi}, got {value}")
        return value

    return parse


INT32_MAX = 2**31 - 1


def _utf8(text, what):
    from ggraph.model import _utf8

    return _utf8(text, what)


def _load(args, n_seq_max: int = 1):
    from ggraph.model import Model

    return Model(
        _utf8(args.model, "the model path") if args.model else args.model,
        device=args.device,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        kv_type=args.kv_type,
        allow_longer_context=args.allow_longer_context,
        n_seq_max=n_seq_max,
    )


def _sampling(args):
    return {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "seed": args.seed,
    }


def _warm_up(model, args):
    """On CUDA, runs a two-token generation with the command's settings and empties the model
    again, as llama.cpp's warm-up run does: the decode graphs a generation uses (the one-token
    step and the generation loop) are captured here, tens of milliseconds the first time, so
    that the first reply and the speed `generate` prints are the generation's own."""
    if not model.device.startswith("cuda") or model.n_ctx < 3:
        return
    chain = getattr(args, "chain", None)  # (chat has none: generate's default)
    for _ in model.generate([0], max_tokens=2, ignore_eos=True, chain=chain, **_sampling(args)):
        pass
    model.reset()


def _check_sampling(args):
    from ggraph import _core

    _core.validate_sampling(**_sampling(args))


def cmd_generate(args):
    _utf8(args.prompt, "the prompt")
    for s in args.stop or []:
        _utf8(s, "--stop")
    _check_sampling(args)
    model = _load(args)
    _warm_up(model, args)
    ids = model.tokenize(args.prompt)
    if not ids:
        raise ValueError("the prompt is empty (it gives no tokens and the model adds no BOS)")
    t0 = time.perf_counter()
    model.eval(ids)  # the prompt, timed on its own; generate() finds it in the cache
    t_prompt = time.perf_counter() - t0
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    t1 = time.perf_counter()
    pieces = model.generate(
        ids,
        max_tokens=args.n_predict,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        chain=args.chain,
        **_sampling(args),
    )
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    t_gen = time.perf_counter() - t1
    sys.stdout.write("\n")
    n_gen = model.n_generated
    print(
        f"[{model.device}] prompt: {len(ids)} tokens, {len(ids) / t_prompt:.1f} tokens/s | "
        f"generated: {n_gen} tokens, {n_gen / max(t_gen, 1e-9):.1f} tokens/s | "
        f"stop: {model.stop_reason}",
        file=sys.stderr,
    )
    return 0


def cmd_chat(args):
    if sys.stdin is None:
        raise ValueError("chat: standard input is closed")
    _check_sampling(args)
    model = _load(args)
    if not model.chat_template:
        raise ValueError(f"chat: {args.model or 'the model'} has no chat template (use generate)")
    _warm_up(model, args)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(
        "ggraph chat: type a message; /exit or Ctrl-D to leave, /reset to start over, Ctrl-C "
        "to stop a reply.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        try:
            _utf8(line, "the message")
        except ValueError as e:
            print(f"[{e}]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for piece in model.chat(messages, max_tokens=args.n_predict, **_sampling(args)):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ValueError as e:  # the conversation outgrew the context
            print(f"\n[{e}; /reset to start over]", file=sys.stderr)
            messages.pop()
            continue
        except KeyboardInterrupt:  # Ctrl-C stops the reply, not the chat: what came of it stays
            print("\n[interrupted]", file=sys.stderr)
            messages.append({"role": "assistant", "content": "".join(reply)})
            continue
        sys.stdout.write("\n")
        if model.stop_reason == "context_full":
            print("[context full: /reset to start over]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args):
    from ggraph.server import serve

    if not 1 <= args.parallel <= 256:
        raise ValueError(f"--parallel: expected 1 to 256 requests at once, got {args.parallel}")
    model = _load(args, n_seq_max=args.parallel)
    name = args.model or "smollm2"
    serve(
        model,
        os.path.basename(name),
        host=args.host,
        port=args.port,
        parallel=args.parallel,
        share_prefixes=args.share_prefixes,
    )
    return 0


def cmd_info(args):
    from collections import Counter

    from ggraph import read_metadata
    from ggraph._core import check_model_file
    from ggraph.model import BUILTIN_CHAT_TEMPLATES, resolve_model

    args.file = resolve_model(_utf8(args.file, "the model path"))
    info = read_metadata(args.file)
    md = info["metadata"]
    arch = md.get("general.architecture", "?")
    if not isinstance(arch, str):  # a malformed file: shown, and check_model_file says why
        arch = repr(arch)
    counts = Counter(t[1] for t in info["tensors"])
    size = sum(t[3] for t in info["tensors"])
    n_params = 0
    for t in info["tensors"]:
        n = 1
        for d in t[2]:
            n *= d
        n_params += n
    print(f"file:           {args.file}")
    print(f"gguf version:   {info['version']}")
    print(f"architecture:   {arch}")
    print(f"name:           {md.get('general.name', '-')}")
    print(f"parameters:     {n_params / 1e6:.1f} M")
    print(f"size:           {size / 2**20:.1f} MiB in {len(info['tensors'])} tensors")
    print("weight formats: " + ", ".join(f"{k} x{v}" for k, v in counts.most_common()))
    for key in (
        "context_length",
        "embedding_length",
        "block_count",
        "attention.head_count",
        "attention.head_count_kv",
        "feed_forward_length",
        "rope.freq_base",
        "attention.sliding_window",
    ):
        if f"{arch}.{key}" in md:
            print(f"{key + ':':<26}{md[f'{arch}.{key}']}")
    tok = md.get("tokenizer.ggml.model", "none")
    print(f"tokenizer:      {tok} (pre: {md.get('tokenizer.ggml.pre', '-')})")
    builtin = "built-in" if arch in BUILTIN_CHAT_TEMPLATES else "no"
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        print(f"chat template:  no ({type(template).__name__}, not text)")
    else:
        print(f"chat template:  {'yes' if template else builtin}")
    reason = check_model_file(args.file)
    print("runs in ggraph: " + ("yes" if not reason else f"no: {reason}"))
    return 0


def cmd_bench(args):
    from ggraph import bench

    return bench.main_args(args)


def _add_model_args(p, sampling=True, kv_default="auto"):
    p.add_argument(
        "-m",
        "--model",
        help="GGUF file, or a short name: smollm2 (the default) or gemma3",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument(
        "-c",
        "--n-ctx",
        type=_int_in(0, INT32_MAX),
        default=None,
        help="context length; 0 = the training length; default 2048, or the training length "
        "where shorter",
    )
    add_context_arguments(p, kv_default)
    p.add_argument("-t", "--threads", type=_int_in(0, 1024), default=None)
    if sampling:  # generate and chat (serve's requests say their own max_tokens)
        p.add_argument("-n", "--n-predict", type=_int_in(0, INT32_MAX), default=128)
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        p.add_argument("--top-k", type=_int_in(0, INT32_MAX), default=40)
        p.add_argument("--top-p", type=float, default=0.95)
        p.add_argument("--min-p", type=float, default=0.05)
        p.add_argument("--repeat-penalty", type=float, default=1.0)
        p.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=None)


def add_context_arguments(p, kv_default="auto"):
    """The KV cache's options, shared by generate, chat, serve and bench."""
    p.add_argument(
        "--kv-type",
        default=kv_default,
        help=f"KV cache elements: auto (f16), f32, f16 or q8_0 (default: {kv_default})",
    )
    p.add_argument(
        "--allow-longer-context",
        action="store_true",
        help="accept a context longer than the model's training context (with a warning)",
    )


def _version() -> str:
    from ggraph import build_info

    info = build_info()
    archs = ", ".join(f"sm_{a}" for a in info.get("cuda_archs", []))
    cuda = f"CUDA for {archs}" if info.get("cuda_compiled") else "CPU only"
    return f"{info['version']} ({cuda})"


def build_parser():
    p = argparse.ArgumentParser(prog="ggraph", description="GGUF language models on GPU and CPU")
    p.add_argument("--version", action="version", version=f"ggraph {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt, streaming the text")
    _add_model_args(g)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument(
        "--ignore-eos", action="store_true", help="go on past an end-of-generation token"
    )
    g.add_argument(
        "--chain",
        type=_int_in(1, 256),
        default=None,
        help="decode steps a launch, sampled on the backend (generate's chain; default: its own)",
    )
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    _add_model_args(c)
    c.add_argument("--system", help="system message")
    c.set_defaults(func=cmd_chat, n_predict=512)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    # F16 caches on every device: half the memory a session, and on the CPU a decode batch's
    # attention over half the bytes (BENCHMARKS: the server's F16 caches).
    _add_model_args(s, sampling=False, kv_default="f16")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_int_in(0, 65535), default=8080)
    s.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="requests served at once, each with a KV cache of its own (1)",
    )
    s.add_argument(
        "--share-prefixes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="copy a prompt's prefix that another request's cache holds instead of evaluating "
        "it again (default: on; never with sliding-window layers)",
    )
    s.set_defaults(func=cmd_serve)
    i = sub.add_parser("info", help="describe a GGUF file")
    i.add_argument("file")
    i.set_defaults(func=cmd_info)
    b = sub.add_parser("bench", help="pp/tg throughput, llama-bench style")
    from ggraph.bench import add_arguments

    add_arguments(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from ggraph import DeviceError, GGUFError

    try:
        return args.func(args)
    except (FileNotFoundError, GGUFError, DeviceError, ValueError) as e:
        print(f"ggraph: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # output to a full disk, a closed descriptor, ...
        print(f"ggraph: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: the work stops where it was, without a traceback (130 = 128 + SIGINT).
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
