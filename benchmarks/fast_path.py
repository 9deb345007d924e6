"""The fast path in one run (issue: static-shape decode steps, compiled): every decoder on its
shipped model, eager and compiled (a preallocated static KV cache, unmask.decode.engine.kv, and a
torch.compile'd step, unmask.decode.engine.static).

Same story openings for every row (greedy, 128 new tokens, 1 thread), at batch 1 and batch 8.
Columns: TPF, TPS, ms per forward (decode seconds / batch forwards), TPS relative to eager AR
and to compiled AR, and, for the compiled rows, compiled/eager TPS of the same decoder. Compiled
rows are timed after an untimed warm-up decode that compiles the step (compile seconds listed).
Then a profile at batch 1 on ``--profile-prompts`` openings: where a decode step's time goes,
inside the model forward (compiled or eager) versus outside it (masks, acceptance, stops,
bookkeeping), per forward.

Checks the targets: compiled >= 2x eager TPS for AR and lossless SBD at batch 1 with identical
tokens; every decoder whose TPF exceeds 1.5 at least as fast as AR in TPS (compiled AR where
the decoder has a compiled path, else eager AR).

    python benchmarks/fast_path.py --threads 1                       # full run, all decoders
    python benchmarks/fast_path.py --limit 5 --decoders ar,sbd --batch-sizes 1   # smoke
    python benchmarks/fast_path.py --limit 3 --decoders ar --batch-sizes 1 --profile-prompts 0  # tables only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import unmask
from unmask.bench.side_by_side import bench
from unmask.decode import DECODERS
from unmask.decode.engine import kv
from unmask.decode.engine import static
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_json, atomic_write_text


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--decoders", default="", help="comma-separated (default: every decoder)")
    p.add_argument("--profile-prompts", type=int, default=20)
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench_fast_path"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = leave as is)")
    p.add_argument("--render", type=Path, help="only rebuild the batch tables of the .md next to this fast_path.json")
    p.add_argument("--profile-only", action="store_true", help="only the per-decoder eager profile (writes "
                   "fast_path_profile.md/.json)")
    return p.parse_args()


def profile(bundle, prompts, max_new_tokens) -> list[dict]:
    """Per-forward time inside vs outside the model forward, batch 1, for eager and compiled
    ``ar`` and lossless ``sbd`` (the forward is wrapped with a timer; compiled steps are warm)."""
    rows = []
    inside = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            inside[0] += time.perf_counter() - t
            return out
        return wrapper

    # both run the one AR / lossless SBD batch (unmask.decode.verify.batch), whose eager forwards go
    # through unmask.decode.engine.kv.forward and whose compiled ones through static.step_function
    setups = [("ar", kv, lambda p, **k: DECODERS["ar"].decode(bundle, p, max_new_tokens=max_new_tokens, **k)),
              ("sbd --verify", kv, lambda p, **k: DECODERS["sbd"].decode(
                  bundle, p, max_new_tokens=max_new_tokens, verify=True, block_size=8, draft="linear", **k))]
    for name, module, run in setups:
        for compiled in (False, True):
            if compiled:
                run(prompts[:1], compile=True)  # warm: compile outside the timing
                # only the compiled step is timed (patching what it traces would recompile it);
                # the eager prefill counts as outside
                orig_step = static.step_function
                static.step_function = lambda m, c, f=orig_step, **kw: timed(f(m, c, **kw))
            else:
                orig_fwd = module.forward
                module.forward = timed(orig_fwd)
            inside[0], total, nfe = 0.0, 0.0, 0
            try:
                for p in prompts:
                    t = time.perf_counter()
                    out = run([p], compile=compiled)
                    total += time.perf_counter() - t
                    nfe += out.stats.nfe
            finally:
                if compiled:
                    static.step_function = orig_step
                else:
                    module.forward = orig_fwd
            rows.append({"decoder": name + (" --compile" if compiled else ""), "ms_per_forward": 1e3 * total / nfe,
                         "forward_ms": 1e3 * inside[0] / nfe, "outside_ms": 1e3 * (total - inside[0]) / nfe})
    return rows


def profile_every(decoders, texts, max_new_tokens) -> list[dict]:
    """Eager, batch 1: for every decoder on its shipped model, per forward, the time inside the
    model's forward (timed by forward hooks, so any decoder's calls count) and outside it, and
    the query tokens a forward feeds. Explains the TPS gaps that compiling cannot close: a
    decoder whose forward dominates and feeds many tokens is bound by the forward itself."""
    from unmask.bench.side_by_side import pairs

    rows = []
    for decoder, model in pairs(decoders=decoders):
        bundle = unmask.load(model)
        clock = {"inside": 0.0, "start": 0.0, "calls": 0, "queries": 0}

        def pre(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            clock["queries"] += ids.shape[0] * ids.shape[1] if ids is not None else 0
            clock["calls"] += 1
            clock["start"] = time.perf_counter()

        def post(module, args, kwargs, output):
            clock["inside"] += time.perf_counter() - clock["start"]

        handles = [bundle.model.register_forward_pre_hook(pre, with_kwargs=True),
                   bundle.model.register_forward_hook(post, with_kwargs=True)]
        try:
            unmask.generate(texts[:1], bundle, decoder, max_new_tokens=8)  # warm-up
            clock.update(inside=0.0, calls=0, queries=0)
            total, tokens = 0.0, 0
            for t in texts:
                t0 = time.perf_counter()
                out = unmask.generate([t], bundle, decoder, max_new_tokens=max_new_tokens)
                total += time.perf_counter() - t0
                tokens += sum(len(x) for x in out.tokens)
        finally:
            for h in handles:
                h.remove()
        n = max(1, clock["calls"])
        rows.append({"decoder": decoder, "model": model, "tpf": tokens / n, "ms_per_forward": 1e3 * total / n,
                     "forward_ms": 1e3 * clock["inside"] / n, "outside_ms": 1e3 * (total - clock["inside"]) / n,
                     "queries_per_forward": clock["queries"] / n})
    return rows


def main():
    args = parse_args()
    if args.profile_prompts < 0 or args.limit < 1 or args.max_new_tokens < 1:
        raise SystemExit("error: --limit and --max-new-tokens must be >= 1 and --profile-prompts >= 0; "
                         "pass e.g. --limit 5 --profile-prompts 0")
    if args.render:
        return render(args.render)
    if args.threads:
        torch.set_num_threads(args.threads)
    decoders = [d for d in args.decoders.split(",") if d] or None
    results, lines = {}, []
    lines.append(f"# Fast path: eager vs compiled ({args.limit} story openings, {args.max_new_tokens} new tokens, "
                 f"greedy, {torch.get_num_threads()} thread(s), torch {torch.__version__})\n")
    failures = []
    if args.profile_only:
        if args.profile_prompts < 1:
            raise SystemExit("error: --profile-only needs --profile-prompts >= 1; pass e.g. --profile-prompts 5")
        return write_profile_only(args, decoders)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        res = bench(limit=args.limit, max_new_tokens=args.max_new_tokens, batch_size=b, decoders=decoders,
                    compile=True)
        lines += batch_lines(b, res.rows, failures)
        results[f"batch_{b}"] = res.to_dict()
    if args.profile_prompts > 0:  # --profile-prompts 0: the batch tables only
        bundle = unmask.load("stories260K-sbd")
        prompts = [bundle.encode(t) for t in STORY_OPENINGS[: args.profile_prompts]]
        prof = profile(bundle, prompts, args.max_new_tokens)
        results["profile"] = prof
        lines += [f"\n## profile, batch 1, stories260K-sbd, {len(prompts)} openings (ms per forward)\n",
                  "| decoder | total | model forward (compiled: the compiled step) | outside (masks, acceptance, "
                  "bookkeeping; compiled: + the eager prefill) |", "|---|---|---|---|"]
        for p in prof:
            lines.append(f"| {p['decoder']} | {p['ms_per_forward']:.3f} | {p['forward_ms']:.3f} | {p['outside_ms']:.3f} |")
        every = profile_every(decoders, STORY_OPENINGS[: args.profile_prompts], args.max_new_tokens)
        results["profile_every"] = every
        lines += every_lines(every, args)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out_dir / "fast_path.md", text)
    atomic_write_json(args.out_dir / "fast_path.json", results)
    print(f"wrote {args.out_dir / 'fast_path.md'} and .json")


def batch_lines(b: int, all_rows: list[dict], failures: list[str]) -> list[str]:
    """The table and target lines of one batch size from ``bench`` rows (ratios filled in place)."""
    lines = []
    rows = [r for r in all_rows if not r.get("error")]
    for r in all_rows:
        if r.get("error"):
            lines.append(f"- batch {b}: {r['decoder']} on {r['model']} failed: {r['error']}")
    by = {(r["decoder"], r["model"]): r for r in rows}  # a decoder runs on several models (block on -bd and -mbd)
    ar_e, ar_c = by.get(("ar", "stories260K")), by.get(("ar --compile", "stories260K"))
    lines += [f"\n## batch {b}\n", "| decoder | model | TPF | TPS | ms/forward | TPS / eager AR | TPS / compiled AR "
              "| compiled / eager | compile s | agree AR | text+NFE = eager |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        r["ms_per_forward"] = 1e3 * r["seconds"] / r["forwards"] if r.get("forwards") else None
        eager = by.get((r["decoder"].replace(" --compile", ""), r["model"])) if r["decoder"].endswith("--compile") else None
        r["vs_eager_ar"] = r["tps"] / ar_e["tps"] if ar_e else None
        r["vs_compiled_ar"] = r["tps"] / ar_c["tps"] if ar_c else None
        r["compiled_vs_eager"] = r["tps"] / eager["tps"] if eager else None
        f = lambda v, s: "–" if v is None else format(v, s)  # noqa: E731
        lines.append(f"| {r['decoder']} | {r['model']} | {r['tpf']:.2f} | {r['tps']:.0f} | {f(r['ms_per_forward'], '.2f')} "
                     f"| {f(r['vs_eager_ar'], '.2f')}x | {f(r['vs_compiled_ar'], '.2f')}x | {f(r['compiled_vs_eager'], '.2f')}x "
                     f"| {f(r.get('compile_s'), '.0f')} | {f(r.get('agreement_positional'), '.3f')} "
                     f"| {f(r.get('same_as_eager'), '.0%')} |")
    if b == 1:
        for d in ("ar --compile", "sbd --verify --compile"):
            r = next((x for (name, _), x in by.items() if name == d), None)
            if r:
                ok = r["compiled_vs_eager"] >= 2.0 and r["same_as_eager"] == 1.0
                lines.append(f"\ntarget: {d} >= 2x eager TPS at batch 1, same tokens: {r['compiled_vs_eager']:.2f}x -> "
                             f"{'met' if ok else 'MISSED'}")
                if not ok:
                    failures.append(d)
    for r in rows:
        if r["tpf"] > 1.5 and not r["decoder"].startswith("ar"):
            ref = ar_c if r["decoder"].endswith("--compile") else ar_e
            if ref:
                ok = r["tps"] >= ref["tps"]
                lines.append(f"target (batch {b}): {r['decoder']} on {r['model']} (TPF {r['tpf']:.2f}) at least as fast as "
                             f"{ref['decoder']}: {r['tps'] / ref['tps']:.2f}x -> {'met' if ok else 'MISSED'}")
    return lines


def render(path: Path) -> None:
    """Rewrite the batch tables of fast_path.md next to ``path`` (a fast_path.json) from its rows,
    keeping the profile sections as they are."""
    results = json.loads(path.read_text())
    md = path.with_suffix(".md")
    text = md.read_text()
    head, rest = text.split("\n## batch", 1)
    tail = rest[rest.index("\n## profile"):]
    lines = [head.rstrip("\n") + "\n"]
    for key in sorted(k for k in results if k.startswith("batch_")):
        lines += batch_lines(int(key.split("_")[1]), results[key]["rows"], [])
    atomic_write_text(md, "\n".join(lines) + "\n" + tail.lstrip("\n").join(["\n", ""]))
    print(f"rewrote {md}")


def write_profile_only(args, decoders) -> None:
    every = profile_every(decoders, STORY_OPENINGS[: args.profile_prompts], args.max_new_tokens)
    text = "\n".join([f"# Fast path: where an eager step's time goes ({args.max_new_tokens} new tokens, greedy, "
                      f"{torch.get_num_threads()} thread(s), torch {torch.__version__})"] + every_lines(every, args)) + "\n"
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out_dir / "fast_path_profile.md", text)
    atomic_write_json(args.out_dir / "fast_path_profile.json", {"profile_every": every})


def every_lines(every, args) -> list[str]:
    lines = [f"\n## profile, batch 1, eager, every decoder on its shipped model, {args.profile_prompts} openings\n",
              "Per model call (timed by forward hooks; TPF here counts every model call, the prefill too).\n",
              "| decoder | model | TPF | ms per call | in the model forward | outside | forward share | "
              "query tokens per call |", "|---|---|---|---|---|---|---|---|"]
    for p in every:
        lines.append(f"| {p['decoder']} | {p['model']} | {p['tpf']:.2f} | {p['ms_per_forward']:.3f} | "
                     f"{p['forward_ms']:.3f} | {p['outside_ms']:.3f} | {p['forward_ms'] / p['ms_per_forward']:.0%} | "
                     f"{p['queries_per_forward']:.1f} |")
    return lines


if __name__ == "__main__":
    main()
