"""The OpenAI server under load, on the loopback address only: many concurrent streaming
clients, clients that disconnect mid-stream, a soak, and the offline engine on the same
requests.

    python bench/serve_load.py [--requests 1000] [--concurrency 64] [--client-processes 1] \
        [--max-tokens 32] \
        [--disconnects 100] [--soak-s 600] [--offline [--min-ratio 0.9]] \
        [--prompt-ids LEN] -- [deepinfer serve options]

On a GPU machine without weights or network, the 4-layer V4-Flash slice of bench/e2e.py with
random weights (`--load-format dummy`, no tokenizer: token-id prompts), the server against
`LLM.generate` on the same requests (bench/README.md has the command and its time):

    python bench/serve_load.py --requests 1024 --concurrency 64 --client-processes 8 \
        --max-tokens 64 --prompt-ids 64 --disconnects 64 --offline --min-ratio 0.9 \
        --start-timeout-s 300 --max-seconds 180 --name serve-load-gpu -- deepseek-v4-flash \
        --load-format dummy --dummy-layers 4 --max-num-seqs 64 --max-model-len 256 \
        --max-num-batched-tokens 1024 --token-buckets 64 128 256 1024

It starts `deepinfer serve` on 127.0.0.1 (a free port) with the options after `--`, then:
(1) `--requests` streamed completions from `--concurrency` clients at once (each asks for
exactly `--max-tokens` tokens, ignore_eos): lost requests (no usage chunk, or the wrong
count) and errors, TTFT and inter-chunk latency percentiles, output tok/s; (2)
`--disconnects` clients that close their stream after two chunks, then the pages in use and
the requests running as /metrics reads them (0 expected); (3) with `--soak-s`, that long of
the same load, the resident memory of the server and its engine process sampled, its
growth after the first fifth;
(4) with `--offline`, `LLM.generate` on the same requests in this process, once the server
has stopped (its engine options parsed as `deepinfer serve` would), and the server's output
tok/s over its; `--min-ratio` fails the run below that ratio. Every phase is bounded by
`--max-seconds` in all. Exits 1 when a check fails.

Prompts are `--input-words` random words, or with `--prompt-ids LEN` LEN random token ids
below `--id-limit` (a model without a tokenizer: its completions have no text, so a chunk
counts as a token's arrival whether or not it carries text, and the tokens are counted from
the usage chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.lib.results import write_results  # noqa: E402

WORDS = ("the", "a", "fox", "dog", "ran", "over", "little", "house", "river", "king", "said",
         "morning", "green", "tree", "sat", "under", "and", "then", "story", "of")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(args, count: int, seed: int = 0) -> list[str] | list[list[int]]:
    """`count` prompts: random words, or with args.prompt_ids that many random token ids."""
    rng = random.Random(seed)
    if args.prompt_ids:
        return [[rng.randrange(2, args.id_limit) for _ in range(args.prompt_ids)]
                for _ in range(count)]
    return [" ".join(rng.choice(WORDS) for _ in range(args.input_words)) for _ in range(count)]


def metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}


def rss_bytes(pid: int) -> int:
    """The resident memory of `pid` and its descendants (the server and its engine process)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += rss_bytes(int(child))
    except FileNotFoundError:          # it ended while we looked
        pass
    return total


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


class Load:
    def __init__(self, base: str, model: str, max_tokens: int):
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                  timeout=600)
        self.model, self.max_tokens = model, max_tokens
        self.ttft, self.itl, self.errors, self.lost, self.tokens = [], [], [], 0, 0

    async def one(self, prompt: str | list[int]) -> None:
        start = time.perf_counter()
        last, usage = None, None
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=self.max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices:          # a token's arrival (text or not: see above)
                    if last is None:
                        self.ttft.append(now - start)
                    else:
                        self.itl.append(now - last)
                    last = now
        except Exception as e:       # counted, reported: the run goes on
            self.errors.append(f"{type(e).__name__}: {e}"[:200])
            return
        if usage is None or usage.completion_tokens != self.max_tokens:
            self.lost += 1
        else:
            self.tokens += usage.completion_tokens

    async def run(self, texts: list, concurrency: int, until: float | None = None) -> None:
        queue = list(reversed(texts))

        async def worker():
            while queue and (until is None or time.monotonic() < until):
                await self.one(queue.pop())
        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def disconnect(self, prompt: str | list[int]) -> None:
        """A client that reads two chunks of its stream and goes away."""
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=self.max_tokens, stream=True,
                temperature=0, extra_body={"ignore_eos": True})
            seen = 0
            async for chunk in stream:
                seen += bool(chunk.choices)
                if seen >= 2:
                    break
            await stream.close()
        except Exception as e:
            self.errors.append(f"{type(e).__name__}: {e}"[:200])


def _client_process(base: str, model: str, max_tokens: int, texts: list, concurrency: int,
                    start_at: float, deadline: float) -> dict:
    """One client process's share of the load (its own event loop and OpenAI client), started
    at `start_at` (time.monotonic(): one clock for the machine's processes)."""
    async def run() -> dict:
        load = Load(base, model, max_tokens)
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        await asyncio.wait_for(load.run(texts, concurrency), deadline - time.monotonic())
        end = time.monotonic()
        await load.client.close()
        return {"ttft": load.ttft, "itl": load.itl, "errors": load.errors, "lost": load.lost,
                "tokens": load.tokens, "end": end}
    return asyncio.run(run())


def spread_load(args, base: str, model: str, texts: list, deadline: float) -> tuple[dict, float]:
    """The load's clients over `--client-processes` processes (texts and clients dealt out in
    turn): one process parsing 64 streams' chunks and sending their next requests would be a
    bottleneck of its own (each of its requests waits for its event loop), which no server
    serving 64 independent users meets. Returns the merged lists and the wall seconds."""
    procs = min(args.client_processes, args.concurrency)
    start_at = time.monotonic() + 5.0               # after every process has started
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        futures = [pool.submit(_client_process, base, model, args.max_tokens, texts[i::procs],
                               len(range(i, args.concurrency, procs)), start_at, deadline)
                   for i in range(procs)]
        parts = [f.result() for f in futures]
    merged = {key: [v for part in parts for v in part[key]] for key in ("ttft", "itl", "errors")}
    merged |= {key: sum(part[key] for part in parts) for key in ("lost", "tokens")}
    return merged, max(part["end"] for part in parts) - start_at


async def phases(args, base: str, model: str, pid: int, deadline: float) -> dict:
    result: dict = {}
    load = Load(base, model, args.max_tokens)
    texts = prompts(args, args.requests)
    if args.client_processes > 1:
        merged, wall = await asyncio.to_thread(spread_load, args, base, model, texts, deadline)
    else:
        start = time.perf_counter()
        await asyncio.wait_for(load.run(texts, args.concurrency), deadline - time.monotonic())
        wall = time.perf_counter() - start
        merged = {"ttft": load.ttft, "itl": load.itl, "errors": load.errors,
                  "lost": load.lost, "tokens": load.tokens}
    result["load"] = {
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "client_processes": min(args.client_processes, args.concurrency),
        "prompts": (f"{args.prompt_ids} random token ids" if args.prompt_ids
                    else f"{args.input_words} random words"),
        "completed": args.requests - merged["lost"] - len(merged["errors"]),
        "lost": merged["lost"], "errors": len(merged["errors"]),
        "error_samples": merged["errors"][:5], "seconds": round(wall, 2),
        "output_tok_per_s": round(merged["tokens"] / wall, 1),
        **{f"ttft_p{q}_s": pct(merged["ttft"], q) for q in (50, 90, 99)},
        **{f"itl_p{q}_s": pct(merged["itl"], q) for q in (50, 90, 99)}}
    if args.disconnects:
        gone = prompts(args, args.disconnects, seed=1)
        load.errors.clear()
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded(p):
            async with sem:
                await load.disconnect(p)
        await asyncio.wait_for(asyncio.gather(*(bounded(p) for p in gone)),
                               deadline - time.monotonic())
        settle = time.monotonic() + 10
        while True:
            m = metrics(base)
            idle = m["deepinfer_num_requests_running"] == m["deepinfer_num_requests_waiting"] == 0
            if idle or time.monotonic() > settle:
                break
            await asyncio.sleep(0.1)
        result["disconnects"] = {
            "clients": args.disconnects, "settled": idle, "errors": len(load.errors),
            "pages_used_after": m["deepinfer_cache_pages_used"],
            "running_after": m["deepinfer_num_requests_running"],
            "aborted_total": m["deepinfer_requests_aborted_total"]}
    if args.soak_s:
        soak = Load(base, model, args.max_tokens)
        until = min(time.monotonic() + args.soak_s, deadline)
        samples: list[tuple[float, int]] = []

        async def sample():
            while time.monotonic() < until:
                samples.append((time.monotonic(), rss_bytes(pid)))
                await asyncio.sleep(5)
        endless = prompts(args, 10**6, seed=2)
        await asyncio.gather(soak.run(endless, args.concurrency, until), sample())
        warm_at = samples[0][0] + (samples[-1][0] - samples[0][0]) / 5
        warm = next(rss for t, rss in samples if t >= warm_at)
        final = samples[-1][1]
        result["soak"] = {"seconds": round(samples[-1][0] - samples[0][0], 1),
                          "requests": soak.tokens // args.max_tokens, "lost": soak.lost,
                          "errors": len(soak.errors), "rss_after_warmup_mib": warm >> 20,
                          "rss_final_mib": final >> 20,
                          "rss_growth_pct": round(100 * (final - warm) / warm, 2)}
    await load.client.close()
    return result


def offline(args, serve_args: list[str], texts: list) -> dict:
    from deepinfer_jax import SamplingParams
    from deepinfer_jax.api import cli

    ap = argparse.ArgumentParser()
    ap.add_argument("model_path", nargs="?")       # `deepinfer serve MODEL`
    cli._engine_args(ap)
    engine_args, _ = ap.parse_known_args(serve_args)
    engine_args.model = engine_args.model or engine_args.model_path
    llm = cli._make_llm(engine_args)
    # the server's requests: greedy (temperature 0), exactly max_tokens each
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(texts[:2], params, use_tqdm=False)           # warm-up
    start = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return {"seconds": round(wall, 2),
            "output_tok_per_s": round(sum(len(o.token_ids) for o in outs) / wall, 1)}


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--input-words", type=int, default=16)
    ap.add_argument("--prompt-ids", type=int, metavar="LEN",
                    help="prompts of LEN random token ids instead of words (a model without a "
                         "tokenizer, e.g. --load-format dummy)")
    ap.add_argument("--id-limit", type=int, default=500,
                    help="with --prompt-ids: the ids lie in [2, N) (N <= the model's vocab)")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="the load's streaming clients spread over this many processes")
    ap.add_argument("--disconnects", type=int, default=100)
    ap.add_argument("--soak-s", type=float, default=0.0)
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--min-ratio", type=float,
                    help="with --offline: fail below this server / LLM.generate tok/s ratio")
    ap.add_argument("--max-seconds", type=float, default=1800)
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--name", default="serve-load")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "deepinfer_jax.api.cli", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--served-model-name", "load", "--log-level", "warning",
         *serve_args], cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
    try:
        up_by = time.monotonic() + args.start_timeout_s
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > up_by:
                    raise SystemExit("the server did not start in time") from None
                time.sleep(0.5)
        deadline = time.monotonic() + args.max_seconds
        result = asyncio.run(phases(args, base, "load", server.pid, deadline))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    if args.offline:
        result["offline"] = offline(args, serve_args, prompts(args, args.requests))
        result["server_vs_offline"] = round(result["load"]["output_tok_per_s"]
                                            / result["offline"]["output_tok_per_s"], 3)
    result["serve_args"] = serve_args
    failures = checks(result, args.min_ratio)
    result["failures"] = failures
    print(json.dumps(result, indent=2))
    write_results(args.name, result, table(result))
    return 1 if failures else 0


def checks(result: dict, min_ratio: float | None = None) -> list[str]:
    out = []
    ratio = result.get("server_vs_offline")
    if min_ratio is not None and ratio is not None and ratio < min_ratio:
        out.append(f"server at {ratio}x LLM.generate's output tok/s (asked: >= {min_ratio}x)")
    load = result["load"]
    if load["lost"] or load["errors"]:
        out.append(f"{load['lost']} lost and {load['errors']} failed requests")
    d = result.get("disconnects")
    if d and (d["pages_used_after"] or d["running_after"] or d["errors"]):
        out.append(f"{d['pages_used_after']} pages in use after the disconnects, "
                   f"{d['errors']} errors")
    s = result.get("soak")
    if s and (s["rss_growth_pct"] >= 5 or s["lost"] or s["errors"]):
        out.append(f"soak: RSS grew {s['rss_growth_pct']}%, {s['lost']} lost, "
                   f"{s['errors']} errors")
    return out


def table(result: dict) -> str:
    load = result["load"]
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"   # noqa: E731
    rows = ["| phase | figure |", "|---|---|",
            f"| load | {load['requests']} requests, {load['concurrency']} streaming clients "
            f"({load.get('client_processes', 1)} processes), "
            f"{load['max_tokens']} tokens each, prompts of {load['prompts']}: "
            f"{load['lost']} lost, {load['errors']} errors, "
            f"{load['output_tok_per_s']} output tok/s |",
            f"| TTFT p50 / p90 / p99 | {ms(load['ttft_p50_s'])} / {ms(load['ttft_p90_s'])} / "
            f"{ms(load['ttft_p99_s'])} ms |",
            f"| inter-chunk p50 / p90 / p99 | {ms(load['itl_p50_s'])} / {ms(load['itl_p90_s'])} / "
            f"{ms(load['itl_p99_s'])} ms |"]
    if "disconnects" in result:
        d = result["disconnects"]
        rows.append(f"| disconnects | {d['clients']} clients gone mid-stream: "
                    f"{d['pages_used_after']:.0f} pages and {d['running_after']:.0f} requests "
                    f"left in use |")
    if "soak" in result:
        s = result["soak"]
        rows.append(f"| soak | {s['seconds']} s, RSS {s['rss_after_warmup_mib']} -> "
                    f"{s['rss_final_mib']} MiB ({s['rss_growth_pct']}%) |")
    if "offline" in result:
        rows.append(f"| LLM.generate, same requests | {result['offline']['output_tok_per_s']} "
                    f"output tok/s (server {result['server_vs_offline']}x) |")
    rows.append(f"\nChecks: {'; '.join(result['failures']) or 'all passed'}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
