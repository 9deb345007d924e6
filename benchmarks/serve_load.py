"""Serving under load: AR vs the model's default decoder behind ``unmask serve``, at 1, 8, 64 and
200 concurrent streams, in one run.

Starts ``unmask serve`` as a subprocess on a free loopback port (nothing else is contacted), then,
for each concurrency level and each decoder, sends a bounded number of greedy streaming
completions (``--requests``, at least the level; a level also stops launching after
``--level-seconds``) through the official ``openai`` async client; two decoders run their requests
of a level in halves, A B B A, so that a drift of the shared machine weighs on both alike. Per level it reports
requests/s, tokens/s, p50/p95 time to first token and end-to-end latency, errors, the server's
resident memory and thread count, and whether every slot and queue entry was freed afterwards
(``/health``). Outputs are compared with AR's at one stream (``same_as_ar``: the fraction of
requests whose text equals AR's) and with the same decoder at one stream (``batch_invariant``).
The closing lines give the default decoder's tokens/s as a ratio of AR's at each level.

    python benchmarks/serve_load.py                 # the full run (minutes; needs an idle machine)
    python benchmarks/serve_load.py --smoke         # 1 and 4 streams, a few short requests
    python benchmarks/serve_load.py --out benchmarks/results/serve_load.json
    python benchmarks/serve_load.py --compile      # the same on the static KV cache, compiled step
    python benchmarks/serve_load.py --compile-vs-eager --levels 1,8   # both servers, ratios in one run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = ["Once upon a time", "Lily", "The sun", "A little cat", "Tom had a big red ball.",
           "One day, a small dog found a stick.", "Sara and her mom went to the park.",
           "There was a happy frog who lived by a pond.", "Ben wanted to fly his kite, but the wind was too weak.",
           "Mia liked to draw. She drew the sun, the trees and her house.", "The old man had a garden full of flowers.",
           "Max was a brave boy. He was not afraid of the dark, but he was afraid of"]


def with_context(words: int) -> list[str]:
    """PROMPTS, each after a shared context of about ``words`` words (the prompts themselves, repeated):
    long prompts, as chat requests with a history have. 0: PROMPTS alone."""
    pool = " ".join(PROMPTS).split()
    context = " ".join(pool[i % len(pool)] for i in range(words))
    return [f"{context} {p}" if words else p for p in PROMPTS]


def start_server(model: str | None, max_batch_size: int, max_queue: int,
                 compile: bool = False, draft_sizes: str | None = None) -> tuple[subprocess.Popen, str]:
    """``unmask serve`` (``--compile``, ``--draft-sizes`` when asked) on 127.0.0.1 and a free port;
    returns the process and its base URL."""
    cmd = [sys.executable, "-m", "unmask", "serve", "--host", "127.0.0.1", "--port", "0", "--max-batch-size",
           str(max_batch_size), "--max-queue", str(max_queue)] + (["--model", model] if model else [])
    cmd += (["--compile"] if compile else []) + (["--draft-sizes", draft_sizes] if draft_sizes else [])
    log = tempfile.NamedTemporaryFile("w+", prefix="unmask-serve-", suffix=".log", delete=False)
    # The server's log goes to a file: a pipe nobody reads would fill up and block the server.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    deadline = time.monotonic() + 300
    url = None
    while url is None and proc.poll() is None and time.monotonic() < deadline:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)", Path(log.name).read_text())
        url = m.group(1) if m else None
        time.sleep(0.2)
    if url is None:
        proc.kill()
        raise SystemExit(f"error: the server did not start; see {log.name}")
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("error: the server did not answer /health; run 'unmask serve' to see why")


def proc_status(pid: int) -> dict:
    """Resident memory (MiB) and thread count of a process, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss_mib"] = int(line.split()[1]) / 1024
        elif line.startswith("Threads:"):
            out["threads"] = int(line.split()[1])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())


def wait_for_compiles(url: str, seconds: float = 900.0) -> None:
    """Wait until the idle ``--compile`` server has compiled every shape its requests ran eagerly."""
    deadline = time.monotonic() + seconds
    while health(url).get("pending_compiles", 0) and time.monotonic() < deadline:
        time.sleep(1.0)


def body(decoder: str) -> dict:
    """The request's extra body for a decoder spec ``NAME[:OPTION=VALUE+...]`` (e.g. ``diffusion:cache=dual``)."""
    name, _, opts = decoder.partition(":")
    extra = {"decoder": name}
    for item in filter(None, opts.split("+")):
        key, _, value = item.partition("=")
        extra[key] = int(value) if value.isdigit() else value
    return extra


async def one(client, model: str, prompt: str, decoder: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 temperature=0, extra_body=body(decoder))
        async for chunk in stream:
            text = chunk.choices[0].text if chunk.choices else ""
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(text)
            usage = chunk.usage or usage
    except Exception as e:  # every failure counts as an error of this level
        return {"error": f"{type(e).__name__}: {str(e)[:120]}", "prompt": prompt}
    end = time.perf_counter() - t0
    return {"prompt": prompt, "text": "".join(parts), "ttft": ttft if ttft is not None else end, "e2e": end,
            "tokens": usage.completion_tokens if usage else 0}


async def level(url: str, model: str, decoder: str, streams: int, requests: int, max_tokens: int,
                seconds: float, prompts: list[str] = PROMPTS) -> tuple[dict, list[dict]]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=max(60.0, seconds))
    gate = asyncio.Semaphore(streams)
    stop_at = time.perf_counter() + seconds

    async def guarded(i):
        async with gate:
            if time.perf_counter() > stop_at:
                return None
            return await one(client, model, prompts[i % len(prompts)], decoder, max_tokens)

    t0 = time.perf_counter()
    results = [r for r in await asyncio.gather(*(guarded(i) for i in range(requests))) if r is not None]
    wall = time.perf_counter() - t0
    await client.close()
    return summary(decoder, streams, results, wall), results


def summary(decoder: str, streams: int, results: list[dict], wall: float) -> dict:
    """One level's row from its requests' results and the seconds they took."""
    ok = [r for r in results if "error" not in r]
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))  # noqa: E731
    return {"decoder": decoder, "streams": streams, "requests": len(results), "errors": len(results) - len(ok),
            "req_s": len(ok) / wall, "tok_s": sum(r["tokens"] for r in ok) / wall, "seconds": wall,
            "ttft_p50": q([r["ttft"] for r in ok], 50), "ttft_p95": q([r["ttft"] for r in ok], 95),
            "e2e_p50": q([r["e2e"] for r in ok], 50), "e2e_p95": q([r["e2e"] for r in ok], 95),
            "error_samples": sorted({r["error"] for r in results if "error" in r})[:3]}


def interleaved(url: str, model: str, decoders: list[str], streams: int, n: int, max_tokens: int,
                seconds: float, server_pid: int, prompts: list[str] = PROMPTS) -> dict[str, tuple[dict, list[dict]]]:
    """Each decoder's ``n`` requests at one level, run as halves, the second round in reverse order
    (A B B A; one decoder: one run), so a drift of the shared machine during the level weighs on all alike.
    Each row also gets the CPU the client (this process) and the server used, in cores (CPU s / wall s):
    on a small machine the client's share is taken from the server."""
    rounds = [(d, n) for d in decoders] if len(decoders) == 1 else \
        [(d, (n + 1) // 2) for d in decoders + decoders[::-1]]
    parts: dict[str, list] = {d: [] for d in decoders}
    for d, k in rounds:
        client, server = time.process_time(), cpu_seconds(server_pid)
        row, results = asyncio.run(level(url, model, d, streams, k, max_tokens, seconds / (len(rounds) // len(decoders)),
                                         prompts))
        parts[d].append((results, row["seconds"], time.process_time() - client, cpu_seconds(server_pid) - server))
    out = {}
    for d, runs in parts.items():
        wall = sum(r[1] for r in runs)
        row = summary(d, streams, [x for r in runs for x in r[0]], wall)
        row.update(client_cores=sum(r[2] for r in runs) / wall, server_cores=sum(r[3] for r in runs) / wall)
        out[d] = row, [x for r in runs for x in r[0]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="served model (default: the default shipped model)")
    ap.add_argument("--levels", default="1,8,64,200", help="concurrent streams per level")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x streams, at least 16)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--context-words", type=int, default=0, help="put a shared context of about this many words "
                    "before every prompt (long prompts; stories260K's context window is 512 tokens)")
    ap.add_argument("--level-seconds", type=float, default=180.0, help="stop launching requests after this")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--draft-sizes", default=None, help="the server's --draft-sizes table (default: its own)")
    ap.add_argument("--decoders", default="ar,default", help="comma-separated; 'default' is the model's default decoder; "
                    "NAME:OPTION=VALUE+... adds request options (e.g. diffusion:cache=dual+block_size=32)")
    ap.add_argument("--smoke", action="store_true", help="1 and 4 streams, 4 requests of 8 tokens")
    ap.add_argument("--compile", action="store_true", help="serve with --compile (static KV cache, compiled step)")
    ap.add_argument("--compile-vs-eager", action="store_true",
                    help="the eager server, then the --compile one, in this run: compiled / eager tokens/s per level")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    levels = [1, 4] if args.smoke else [int(x) for x in args.levels.split(",")]
    max_tokens = 8 if args.smoke else args.max_tokens
    runs = [False, True] if args.compile_vs_eager else [args.compile]
    results = {c: serve_and_load(args, levels, max_tokens, c) for c in runs}
    if args.compile_vs_eager:
        eager, compiled = results[False]["rows"], results[True]["rows"]
        for a in eager:
            b = next(r for r in compiled if r["decoder"] == a["decoder"] and r["streams"] == a["streams"])
            ratio = b["tok_s"] / a["tok_s"] if a["tok_s"] else float("nan")
            print(f"compiled / eager server, {a['decoder']} at {a['streams']} streams: {ratio:.2f}x "
                  f"({b['tok_s']:.1f} / {a['tok_s']:.1f} tok/s); same text: {b['texts'] == a['texts']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        body = results[runs[0]] if len(runs) == 1 else {"eager": results[False], "compiled": results[True]}
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(args.out)


def serve_and_load(args, levels: list[int], max_tokens: int, compile: bool) -> dict:
    """One server (``compile`` or eager) under every decoder and level; returns its JSON record."""
    proc, url = start_server(args.model, args.max_batch_size, max(256, 2 * max(levels)), compile=compile,
                             draft_sizes=args.draft_sizes)
    try:
        info = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())["data"][0]
        decoders = [info["default_decoder"] if d == "default" else d for d in args.decoders.split(",")]
        decoders = [d for d in dict.fromkeys(decoders) if d.partition(":")[0] in info["decoders"]]
        prompts = with_context(args.context_words)
        asyncio.run(level(url, info["id"], decoders[0], 1, 2, max_tokens, 60, prompts))  # warm-up
        wait_for_compiles(url)
        before = proc_status(proc.pid)
        rows, texts, runs = [], {}, {}
        for streams in levels:  # the decoders interleaved per level (ABBA halves): ratios in one stretch of time
            n = 4 if args.smoke else (args.requests or max(16, 2 * streams))
            if compile:  # reach the shapes this level steps, then let the idle server compile them: requests
                # arriving while others run (4 per stream, at most the level's), as in the timed part, whose
                # caches reach longer length buckets than one wave started together
                for decoder in decoders:
                    asyncio.run(level(url, info["id"], decoder, streams, min(n, 4 * streams), max_tokens, 300, prompts))
                wait_for_compiles(url)
            warm = proc_status(proc.pid)["rss_mib"]  # after this level's compiles: its timed part's growth is from here
            got = interleaved(url, info["id"], decoders, streams, n, max_tokens, args.level_seconds, proc.pid, prompts)
            h, status = health(url), proc_status(proc.pid)
            for decoder, (row, results) in got.items():
                row.update(status, leaked_slots=h["active"], left_in_queue=h["queue_depth"], rss_warm_mib=warm,
                           eager_shapes=h.get("pending_compiles", 0))  # --compile: step shapes the level ran eagerly
                runs[(decoder, streams)] = row, results
        for decoder in decoders:
            for streams in levels:
                row, results = runs[(decoder, streams)]
                texts[(decoder, streams)] = {r["prompt"]: r["text"] for r in results if "error" not in r}
                ref_ar = texts.get(("ar", levels[0]), {})
                ref_self = texts[(decoder, levels[0])]
                got = texts[(decoder, streams)]
                row["same_as_ar"] = (sum(got[p] == ref_ar.get(p) for p in got) / len(got)) if got and ref_ar else None
                row["batch_invariant"] = all(got[p] == ref_self.get(p, got[p]) for p in got)
                row["texts"] = dict(sorted(got.items()))
                rows.append(row)
                print(f"{'compiled' if compile else 'eager'} {decoder:>5} {streams:>4} streams: {row['requests']:>4} req, "
                      f"{row['errors']} err, "
                      f"{row['req_s']:.2f} req/s, {row['tok_s']:.1f} tok/s, TTFT p50/p95 {row['ttft_p50']:.3f}/"
                      f"{row['ttft_p95']:.3f} s, e2e p50/p95 {row['e2e_p50']:.3f}/{row['e2e_p95']:.3f} s, "
                      f"CPU server/client {row['server_cores']:.2f}/{row['client_cores']:.2f} cores, "
                      f"RSS {row['rss_mib']:.1f} MiB, threads {row['threads']}, leaked slots {row['leaked_slots']}, "
                      + (f"eager shapes {row['eager_shapes']}, " if compile else "") + f"same as AR {row['same_as_ar']}, batch-invariant {row['batch_invariant']}", flush=True)
        after = proc_status(proc.pid)
        print(f"server RSS before {before['rss_mib']:.1f} MiB, after {after['rss_mib']:.1f} MiB "
              f"({100 * (after['rss_mib'] / before['rss_mib'] - 1):+.1f} %)")
        timed = sum(max(r["rss_mib"] - r["rss_warm_mib"], 0) for r in rows if r["decoder"] == decoders[0])
        print(f"server RSS growth while the timed levels ran (each level's compiles excluded): {timed:.1f} MiB "
              f"({100 * timed / before['rss_mib']:+.1f} %)")
        if "ar" in decoders and len(decoders) > 1:
            other = decoders[1]
            for streams in levels:
                a = next(r for r in rows if r["decoder"] == "ar" and r["streams"] == streams)
                b = next(r for r in rows if r["decoder"] == other and r["streams"] == streams)
                ratio = b["tok_s"] / a["tok_s"] if a["tok_s"] else float("nan")
                print(f"{other} / ar tokens/s at {streams} streams: {ratio:.2f}x")
        return {"model": info["id"], "compile": compile, "max_tokens": max_tokens, "levels": levels,
                "rss_before_mib": before["rss_mib"], "rss_after_mib": after["rss_mib"], "rss_timed_growth_mib": timed,
                "rows": rows}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
