"""A bounded load test of an OpenAI-compatible server (`ggraph serve`, or any other): N
concurrent streaming clients send a fixed number of chat requests between them; reports the
aggregate generation speed and the time to first token and between tokens (p50 / p99).

    python tools/serve_load.py [--url http://127.0.0.1:8080/v1] [-c 8] [-n 32] [--max-tokens 64]
                               [--turns T] [--completions] [-p PROCESSES]

Each request asks for max_tokens at temperature 0.8 with its own seed; the aggregate counts the
completion tokens the server reports in each stream's usage, and the latencies come from the
stream's chunks that carry text.
--turns T makes the requests conversations of T turns (each turn's messages are the ones
before, the answer and "Go on."), and adds the later turns' time to first token. The share of
prompt tokens the server reported as cached (usage.prompt_tokens_details.cached_tokens) is
printed after the table.
--completions sends text completions instead of chats, for a model without a chat template
(the random-weight files of `python -m ggraph.testing`). The clients are threads spread over
-p processes (default: one for every four clients), so that parsing thousands of chunks a
second does not make the load generator the bottleneck; the busiest process's CPU use is
printed after the table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import threading
import time


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def run_share(args, clients: int, next_request, barrier, results) -> None:
    """Requests taken from the shared counter on `clients` threads; puts this process's
    figures."""
    from openai import OpenAI  # optional: only this tool and the tests need it

    client = OpenAI(base_url=args.url, api_key="none", max_retries=0, timeout=600)
    lock = threading.Lock()
    ttft, itl, usage, errors = [], [], [0], []
    later_ttft, prompt = [], [0, 0]  # turns after the first; prompt tokens, cached ones

    def worker():
        try:
            requests()
        except Exception as e:  # a refused connection, an error in the stream
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

    def requests():
        while True:
            with next_request.get_lock():
                i = next_request.value
                if i >= args.requests:
                    return
                next_request.value += args.turns
            text = f"Tell me a short story, number {i}."
            messages = [{"role": "user", "content": text}]
            for turn in range(min(args.turns, args.requests - i)):
                answer = request(i + turn, text, messages, turn > 0)
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Go on."},
                ]

    def request(i, text, messages, later):
        t0 = time.perf_counter()
        last = None
        request = dict(
            model=args.model,
            max_tokens=args.max_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        if args.completions:
            stream = client.completions.create(prompt=text, **request)
        else:
            stream = client.chat.completions.create(messages=messages, **request)
        pieces = []
        for chunk in stream:
            if chunk.usage is not None:
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                with lock:
                    usage[0] += chunk.usage.completion_tokens
                    prompt[0] += chunk.usage.prompt_tokens
                    prompt[1] += getattr(details, "cached_tokens", None) or 0
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = choice.text if args.completions else choice.delta.content
            if not piece:
                continue
            pieces.append(piece)
            now = time.perf_counter()
            with lock:
                if last is None:
                    ttft.append(now - t0)
                    if later:
                        later_ttft.append(now - t0)
                else:
                    itl.append(now - last)
            last = now
        return "".join(pieces)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    barrier.wait()  # every process ready: the clients start together
    start, cpu = time.time(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.time()
    busy = (time.process_time() - cpu) / max(end - start, 1e-9)
    results.put((ttft, itl, usage[0], start, end, busy, errors, later_ttft, prompt))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("-n", "--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="default")
    ap.add_argument("--turns", type=int, default=1, help="turns a conversation (chats)")
    ap.add_argument("--completions", action="store_true", help="/v1/completions, not chats")
    ap.add_argument("-p", "--processes", type=int, default=0, help="client processes")
    args = ap.parse_args()
    if args.turns < 1 or (args.turns > 1 and args.completions):
        ap.error("--turns takes 1 or more, and chats only")

    procs = args.processes or (args.concurrency + 3) // 4
    procs = max(1, min(procs, args.concurrency, args.requests))
    ctx = multiprocessing.get_context("spawn")
    barrier, results, next_request = ctx.Barrier(procs), ctx.Queue(), ctx.Value("i", 0)
    workers = []
    for j in range(procs):
        clients = args.concurrency // procs + (j < args.concurrency % procs)
        workers.append(
            ctx.Process(target=run_share, args=(args, clients, next_request, barrier, results))
        )
    for w in workers:
        w.start()
    shares = []
    while len(shares) < procs:
        try:
            shares.append(results.get(timeout=1))
        except queue.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                barrier.abort()  # the others may wait for the one that died
                for w in workers:
                    w.terminate()
                print("a client process failed (its error is above)")
                return 1
    for w in workers:
        w.join()
    errors = [e for sh in shares for e in sh[6]]
    if errors:
        print(f"{len(errors)} clients failed; the first: {errors[0]}")
    ttft = [v for sh in shares for v in sh[0]]
    if not ttft or not any(sh[1] for sh in shares):
        print("no tokens came back")
        return 1
    itl = [v for sh in shares for v in sh[1]]
    usage = sum(sh[2] for sh in shares)
    elapsed = max(sh[4] for sh in shares) - min(sh[3] for sh in shares)
    print("| clients | requests | generated tokens (usage) | aggregate tok/s | TTFT p50 / p99 ms "
          "| inter-token p50 / p99 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.concurrency} | {args.requests} | {usage} | {usage / elapsed:.1f} | "
        f"{1e3 * statistics.median(ttft):.0f} / {1e3 * percentile(ttft, 99):.0f} | "
        f"{1e3 * statistics.median(itl):.1f} / {1e3 * percentile(itl, 99):.1f} |"
    )
    n_prompt, n_cached = sum(sh[8][0] for sh in shares), sum(sh[8][1] for sh in shares)
    line = f"prompt tokens {n_prompt}, cached {n_cached} ({100 * n_cached / max(n_prompt, 1):.0f}%)"
    later = [v for sh in shares for v in sh[7]]
    if later:
        line += (
            f"; later turns' TTFT p50 / p99 {1e3 * statistics.median(later):.0f} / "
            f"{1e3 * percentile(later, 99):.0f} ms"
        )
    print(line)
    busiest = max(sh[5] for sh in shares)
    print(f"{procs} client processes; the busiest used {100 * busiest:.0f}% of a core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
