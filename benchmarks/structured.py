"""Structured output under lossless decoding vs constrained AR, in one run (issue 50, spec/structured.md).

1. Story models, greedy, ``--max-new-tokens`` (128) new tokens, on the first ``--prompts`` (100) story openings
   (as benchmarks/sbd_lossless.py picks them), under each of three JSON schemas (:data:`SCHEMAS`: a flat object;
   a nested object with an enum; an array of records):

   * ``stories260K-sbd`` (fully fine-tuned SBD): constrained AR and constrained lossless SBD on the model itself;
   * ``stories260K+sbd`` (the shipped gated ``sbd`` adapter): constrained AR on the plain ``stories260K``, the
     model the user had before the adapter, and constrained lossless SBD on ``unmask.load("stories260K",
     adapter="sbd")``.

   Per (model, schema): prompts whose ids equal constrained AR's; rows that finished with a stop token and
   whose text parses as JSON and validates against the schema (``jsonschema``); TPF (committed tokens, the stop
   token included, per row forward) of constrained lossless, of unconstrained lossless (the same prompts, no
   grammar: one figure per model) and of constrained AR; tokens/s of constrained lossless / constrained AR at
   batch 1 (one warm-up call per column, then per prompt both columns back to back, the order alternating);
   forced tokens per row (the decoder's count where its statistics report one, and the tokens where the
   grammar allowed exactly one id, replayed over the output); and at batch ``--batch`` (8) the share of the
   decode call's wall time spent in grammar work: every :class:`unmask.grammar.Matcher` method, the per-row
   matcher copies and the bitmask unpacking (:func:`unmask.grammar.allowed`), timed by wrappers this script
   installs (the outermost call counted once; no library code changed), and beside it the share of the verify
   batch's whole per-step shaping (verify/shaped.py's ``Shaping`` methods), the grammar work included.
2. SmolLM2-135M-Instruct (``smollm2-135m``, if installed: README "A real base"), ``--smollm2-prompts`` (20) chat
   prompts asking for a JSON object (:data:`SMOLLM2_SCHEMA`): constrained AR on the plain model, constrained
   lossless SBD with its shipped ``sbd`` adapter: identical to constrained AR, valid, TPF.
3. logprobs (``logprobs=5``, float32, no grammar) on the same story openings at batch 1: the max |lossless - AR|
   of each token's logprob and of its top-5 values, over the tokens where both agree (greedy: all of them).

Targets (issue 50), PASS / MISS: identical to constrained AR 100 %; valid 100 % of finished rows; TPF
constrained lossless >= TPF unconstrained lossless; tok/s constrained lossless >= 1.5x constrained AR at batch
1; grammar work <= 15 % of the call at batch 8; SmolLM2 identical 100 %; logprobs max |delta| <= 1e-5.

Runtime on one core of a shared 2-core machine (load about 2): part 1 about 4 minutes, part 2 about 8 (SmolLM2
at 128 tokens, four decodes per prompt), part 3 about 2; ``--quick`` about a minute.

    python benchmarks/structured.py                  # everything (the report: benchmarks/results/structured.md)
    python benchmarks/structured.py --quick          # a smoke run: 6 prompts (SmolLM2 2), 64 tokens
    python benchmarks/structured.py --only stories   # part 1 alone
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import torch

import unmask
import unmask.grammar as grammar_module
from unmask.api import prepare_prompts
from unmask.decode import spec_for
from unmask.eval.story_openings import STORY_OPENINGS
from unmask.fileio import atomic_write_text
from unmask.grammar import Grammar, Matcher, compile

RESULTS = Path(__file__).resolve().parent / "results" / "structured.md"
NAME = {"type": "string", "maxLength": 16}
SCHEMAS = {
    "flat object": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 1, "maximum": 99},
                                                     "kind": {"type": "boolean"}},
                    "required": ["name", "age", "kind"], "additionalProperties": False},
    "nested + enum": {"type": "object", "properties": {
        "hero": {"type": "object", "properties": {"name": NAME, "mood": {"enum": ["happy", "sad", "angry", "scared"]}},
                 "required": ["name", "mood"], "additionalProperties": False},
        "place": {"type": "string", "maxLength": 24}}, "required": ["hero", "place"], "additionalProperties": False},
    "array of records": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "friend": {"type": "boolean"}},
        "required": ["name", "friend"], "additionalProperties": False}},
}
SMOLLM2_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                   "description": {"type": "string", "maxLength": 160},
                                                   "rating": {"type": "integer", "minimum": 1, "maximum": 10}},
                  "required": ["name", "description", "rating"], "additionalProperties": False}
SUBJECTS = ("a red fox", "the city of Paris", "a cup of green tea", "the planet Mars", "a pine tree", "a violin",
            "the river Nile", "a honeybee", "a lighthouse", "the game of chess", "an old bicycle", "a thunderstorm",
            "a sourdough bread", "the moon", "a dolphin", "a mountain cabin", "the color blue", "a library",
            "a paper kite", "a snowy owl")
FIELDS = ("ids", "nfe", "committed", "seconds", "forced")


@dataclass
class Runs:
    """One way of decoding over a prompt set: per row its ids; per call its row forwards, committed tokens,
    wall seconds and decoder-reported forced tokens."""

    name: str
    data: dict = field(default_factory=lambda: {k: [] for k in FIELDS})

    def tpf(self) -> float:
        return sum(self.data["committed"]) / max(1, sum(self.data["nfe"]))

    def tps(self) -> float:
        return sum(map(len, self.data["ids"])) / max(1e-9, sum(self.data["seconds"]))


def decoder(bundle, name: str, **options):
    """``run(ids, max_new, **asks) -> (rows of ids, counters)`` with decoder ``name`` on ``bundle``."""
    spec = spec_for(name, bundle.kind)

    def run(ids, max_new, **asks):
        t0 = time.perf_counter()
        out = spec.decode(bundle, ids, max_new_tokens=max_new, stop_token_ids=bundle.stop_token_ids, **options, **asks)
        s = out.stats
        extras = s.extra.get("row_extra") or []  # a grammar row's "forced": ids committed in a draft, never predicted
        forced = sum(e["forced"] for e in extras) if any("forced" in e for e in extras) else None
        return out, {"nfe": sum(s.nfe_per_row), "committed": s.generated + sum(s.stops_per_row),
                     "seconds": time.perf_counter() - t0, "forced": forced}
    return run


def measure(columns: list[tuple[Runs, object, dict]], groups: list[list[list[int]]], max_new: int,
            clocks: list = ()) -> None:
    """Per group every column back to back, the order reversed from group to group, after one untimed
    warm-up call per column (8 tokens); ``clocks`` run through the timed calls only."""
    for _, run, asks in columns:
        run(groups[0], min(8, max_new), **asks)
    with contextlib.ExitStack() as stack:
        for c in clocks:
            stack.enter_context(c)
        timed(columns, groups, max_new)


def timed(columns, groups, max_new: int) -> None:
    for j, group in enumerate(groups):
        for runs, run, asks in (columns if j % 2 == 0 else columns[::-1]):
            out, st = run(group, max_new, **asks)
            runs.data["ids"] += out.tokens
            for k in FIELDS[1:]:
                runs.data[k].append(st[k])


class Clock:
    """Wall seconds spent in the wrapped methods while active (``targets``: (owner, method name) pairs).
    Nested calls (``path_masks`` calling ``mask``) count once, in the outermost."""

    def __init__(self, targets):
        self.targets, self.seconds, self._depth, self._undo = list(targets), 0.0, 0, []

    def _timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if self._depth:
                return fn(*a, **k)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
                self._depth -= 1
        return wrapper

    def __enter__(self):
        for owner, name in self.targets:
            self._undo.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, self._timed(owner.__dict__[name]))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()


def grammar_clock() -> Clock:
    """Grammar work: every public :class:`Matcher` method, the per-row matcher copies (``Compiled.matcher``)
    and :func:`unmask.grammar.allowed` wherever a module imported it."""
    targets = [(Matcher, n) for n in ("consume", "forced", "mask", "path_masks", "draft") if n in Matcher.__dict__]
    targets.append((grammar_module.Compiled, "matcher"))
    targets += [(m, "allowed") for n, m in list(sys.modules.items())
                if n.startswith("unmask") and m is not None and m.__dict__.get("allowed") is grammar_module.allowed]
    return Clock(targets)


def shaping_clock() -> Clock:
    """All of the verify batch's per-step shaping (its ``Shaping`` methods: drafts rebuilt, masks filled,
    logits masked, logprob columns, matchers advanced), grammar work included; empty if it moved."""
    try:
        from unmask.decode.verify.shaped import Shaping
    except ImportError:
        return Clock([])
    return Clock([(Shaping, n) for n in ("prepare", "apply", "record", "after_read", "prefill", "prefilled")
                  if n in Shaping.__dict__])


def forceable(bundle, compiled, rows: list[list[int]]) -> float:
    """Mean tokens per row where the grammar allowed exactly one id (replayed over the output)."""
    total = 0
    for ids in rows:
        m = compiled.matcher()
        bits = torch.zeros(m.words, dtype=torch.int32)
        for t in ids:
            m.mask(bits)
            total += int(grammar_module.allowed(bits, compiled.vocab).sum()) == 1
            if not m.consume([t]):
                break
    return total / max(1, len(rows))


def validity(bundle, prompts, rows, schema, max_new: int) -> tuple[int, int]:
    """(rows that finished with a stop token, of them those whose text is JSON valid under ``schema``)."""
    finished = valid = 0
    for p, ids in zip(prompts, rows):
        if len(ids) >= max_new:
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(bundle.decode_continuation(p, ids)), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return finished, valid


def compare(label: str, ar_bundle, sbd_bundle, prompts, schemas: dict, args) -> list[dict]:
    """Part 1 / 2 for one model: constrained AR vs constrained lossless per schema, unconstrained lossless,
    and the grammar share at batch ``args.batch``."""
    ar, sbd = decoder(ar_bundle, "ar"), decoder(sbd_bundle, "sbd", verify=True)
    free = Runs("lossless")
    measure([(free, sbd, {})], [[p] for p in prompts], args.max_new_tokens)
    rows = []
    for name, schema in schemas.items():
        g = Grammar.json_schema(schema)
        c_ar, c_sbd = Runs("ar+grammar"), Runs("lossless+grammar")
        measure([(c_ar, ar, {"grammar": g}), (c_sbd, sbd, {"grammar": g})], [[p] for p in prompts], args.max_new_tokens)
        batched = Runs("lossless+grammar b8")
        clock, shaping = grammar_clock(), shaping_clock()
        measure([(batched, sbd, {"grammar": g})], [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)],
                args.max_new_tokens, [clock, shaping])
        fin, ok = validity(sbd_bundle, prompts, c_sbd.data["ids"], schema, args.max_new_tokens)
        ar_fin, ar_ok = validity(ar_bundle, prompts, c_ar.data["ids"], schema, args.max_new_tokens)
        reported = [f for f in c_sbd.data["forced"] if f is not None]
        rows.append({"model": label, "schema": name, "prompts": len(prompts),
                     "identical": sum(a == b for a, b in zip(c_ar.data["ids"], c_sbd.data["ids"])),
                     "finished": fin, "valid": ok, "ar_finished": ar_fin, "ar_valid": ar_ok,
                     "tpf": c_sbd.tpf(), "tpf_free": free.tpf(), "tpf_ar": c_ar.tpf(),
                     "tps": c_sbd.tps(), "tps_ar": c_ar.tps(), "speedup": c_sbd.tps() / c_ar.tps(),
                     "forced": sum(reported) / len(prompts) if reported else None,
                     "forceable": forceable(sbd_bundle, compile(sbd_bundle, g), c_sbd.data["ids"]),
                     "grammar_share": clock.seconds / max(1e-9, sum(batched.data["seconds"])),
                     "shaping_share": shaping.seconds / max(1e-9, sum(batched.data["seconds"])),
                     "differ": [i for i, (a, b) in enumerate(zip(c_ar.data["ids"], c_sbd.data["ids"])) if a != b]})
        r = rows[-1]
        print(f"  {label} / {name}: identical {r['identical']}/{len(prompts)}, valid {ok}/{fin}, TPF {r['tpf']:.2f} "
              f"(free {r['tpf_free']:.2f}, AR {r['tpf_ar']:.2f}), {r['speedup']:.2f}x AR, grammar "
              f"{100 * r['grammar_share']:.1f} % at batch {args.batch}", flush=True)
    return rows


STORY_MODELS = (("stories260K-sbd", "stories260K-sbd", {}), ("stories260K+sbd", "stories260K", {"adapter": "sbd"}))


def load_pair(name: str, sbd_kw: dict):
    """(AR bundle, lossless bundle) of a shipped SBD route: one bundle for a fine-tuned model (no ``sbd_kw``),
    else the base and the base with ``sbd_kw`` (its gated adapter)."""
    ar_bundle = unmask.load(name)
    return ar_bundle, unmask.load(name, **sbd_kw) if sbd_kw else ar_bundle


def stories(args) -> list[dict]:
    texts = list(STORY_OPENINGS[:args.prompts])
    out = []
    for label, name, sbd_kw in STORY_MODELS:
        ar_bundle, sbd_bundle = load_pair(name, sbd_kw)
        torch.set_num_threads(args.threads)  # loading may apply the size-based default
        print(f"{label}: {len(texts)} story openings x {len(SCHEMAS)} schemas", flush=True)
        out += compare(label, ar_bundle, sbd_bundle, prepare_prompts(ar_bundle, texts)[1], SCHEMAS, args)
    return out


def smollm2(args) -> list[dict]:
    try:
        base = unmask.load("smollm2-135m")
        sbd = unmask.load("smollm2-135m", adapter="sbd")
    except unmask.UnmaskError as e:
        print(f"smollm2-135m skipped: {e}", flush=True)
        return []
    torch.set_num_threads(args.threads)
    texts = [f"Describe {s} as a JSON object with a name, a one-sentence description and a rating from 1 to 10."
             for s in SUBJECTS[:args.smollm2_prompts]]
    print(f"smollm2-135m: {len(texts)} chat prompts asking for JSON", flush=True)
    return compare("smollm2-135m+sbd", base, sbd, prepare_prompts(base, texts, chat=True)[1],
                   {"name/description/rating": SMOLLM2_SCHEMA}, args)


def logprobs(args) -> list[dict]:
    texts = list(STORY_OPENINGS[:args.logprob_prompts])
    out = []
    for label, name, sbd_kw in STORY_MODELS:
        ar_bundle, sbd_bundle = load_pair(name, sbd_kw)
        ar, sbd = decoder(ar_bundle, "ar"), decoder(sbd_bundle, "sbd", verify=True)
        worst = worst_top = 0.0
        tokens = same_top = 0
        for p in prepare_prompts(ar_bundle, texts)[1]:
            a, _ = ar([p], args.max_new_tokens, logprobs=5)
            b, _ = sbd([p], args.max_new_tokens, logprobs=5)
            if a.logprobs is None or b.logprobs is None:  # a decoder that ignores logprobs: say so, measure nothing
                note = f"no logprobs returned (ar: {a.logprobs is not None}, lossless: {b.logprobs is not None})"
                print(f"  logprobs {label}: {note}", flush=True)
                out.append({"model": label, "prompts": len(texts), "note": note})
                break
            for x, y in zip(a.logprobs[0], b.logprobs[0]):
                if x.token != y.token:
                    break
                tokens += 1
                worst = max(worst, abs(x.logprob - y.logprob))
                tops = dict(y.top)  # by id: a near tie may order the two top-k lists differently
                same_top += set(tops) == {i for i, _ in x.top}
                worst_top = max([worst_top] + [abs(v - tops[i]) for i, v in x.top if i in tops])
        else:
            w64 = float64_delta(name, sbd_kw, texts[:20], args.max_new_tokens)
            out.append({"model": label, "prompts": len(texts), "tokens": tokens, "max_delta": worst,
                        "max_delta_top": worst_top, "same_top": same_top, "max_delta_float64": w64})
            print(f"  logprobs {label}: max |lossless - AR| {worst:.2e} (top-5 {worst_top:.2e}; top-5 ids equal at "
                  f"{same_top}/{tokens} tokens) over {tokens} tokens; the model in float64: {w64:.2e}", flush=True)
    return out


def float64_delta(name: str, sbd_kw: dict, texts: list[str], max_new_tokens: int) -> float:
    """max |lossless - AR| of every logprob and top-5 value with the model's weights in float64: what is left
    of the float32 difference once the two forwards' rounding is gone (the logprobs are float32 still)."""
    ar_bundle, sbd_bundle = load_pair(name, sbd_kw)
    for b in {id(ar_bundle): ar_bundle, id(sbd_bundle): sbd_bundle}.values():
        b.model.double()
    ar, sbd = decoder(ar_bundle, "ar"), decoder(sbd_bundle, "sbd", verify=True)
    worst = 0.0
    for p in prepare_prompts(ar_bundle, texts)[1]:
        a, _ = ar([p], max_new_tokens, logprobs=5)
        b, _ = sbd([p], max_new_tokens, logprobs=5)
        for x, y in zip(a.logprobs[0], b.logprobs[0]):
            if x.token != y.token:
                break
            tops = dict(y.top)
            worst = max([worst, abs(x.logprob - y.logprob)] + [abs(v - tops[i]) for i, v in x.top if i in tops])
    return worst


def targets(rows: list[dict], lp: list[dict], batch: int) -> list[tuple[str, str, str, bool]]:
    out = []
    for r in rows:
        where = f"{r['model']} / {r['schema']}"
        out.append((where, "identical to constrained AR 100 %", f"{r['identical']}/{r['prompts']}",
                    r["identical"] == r["prompts"]))
        out.append((where, "valid 100 % of finished rows", f"{r['valid']}/{r['finished']}",
                    r["finished"] > 0 and r["valid"] == r["finished"]))
        if r["model"].startswith("smollm2"):
            continue
        out.append((where, "TPF constrained >= unconstrained lossless", f"{r['tpf']:.2f} vs {r['tpf_free']:.2f}",
                    r["tpf"] >= r["tpf_free"]))
        out.append((where, "tok/s >= 1.5x constrained AR (batch 1)", f"{r['speedup']:.2f}x", r["speedup"] >= 1.5))
        out.append((where, f"grammar work <= 15 % of the call (batch {batch})", f"{100 * r['grammar_share']:.1f} %",
                    r["grammar_share"] <= 0.15))
    for r in lp:
        if "note" in r:
            out.append((r["model"], "logprobs max |lossless - AR| <= 1e-5", r["note"], False))
            continue
        worst = max(r["max_delta"], r["max_delta_top"])
        out.append((r["model"], "logprobs max |lossless - AR| <= 1e-5", f"{worst:.1e} over {r['tokens']} tokens",
                    r["tokens"] > 0 and worst <= 1e-5))
        out.append((r["model"], "logprobs top-5 ids equal to AR's", f"{r['same_top']}/{r['tokens']}",
                    r["tokens"] > 0 and r["same_top"] == r["tokens"]))
    return out


def markdown(rows: list[dict], lp: list[dict], checks, env: dict) -> str:
    pct = lambda a, b: f"{a}/{b}" if b else "-"  # noqa: E731
    lines = [f"# Structured output under lossless decoding (issue 50): {env['date']}", ""]
    if env["quick"]:
        lines += ["**A `--quick` smoke run** (few prompts, short outputs): not the issue's figures.", ""]
    reported = " forced per row (decoder) |" if any(r["forced"] is not None for r in rows) else ""
    lines += [f"CPU {env['cpu']}, {env['threads']} thread(s), torch {env['torch']}, llguidance {env['llguidance']}; load "
              f"average {env['load_start']} at the start, {env['load_end']} at the end; {env['seconds']:.0f} s in all ("
              f"{', '.join(f'{k} {v:.0f} s' for k, v in env['parts'].items())}); "
              f"greedy, float32, {env['max_new_tokens']} new tokens.", "",
              f"Command: `python benchmarks/structured.py {env['argv']}`", "",
              "| model | schema | identical to constrained AR | valid / finished (lossless) | valid / finished (AR) | "
              "TPF constrained lossless | TPF unconstrained lossless | TPF constrained AR | tok/s lossless | "
              f"tok/s AR | lossless / AR |{reported} forceable per row | grammar share (batch {env['batch']}) | "
              f"shaping share (batch {env['batch']}) |", "|" + "---|" * (14 + bool(reported))]
    for r in rows:
        forced = "" if not reported else " - |" if r["forced"] is None else f" {r['forced']:.1f} |"
        lines.append(f"| {r['model']} | {r['schema']} | {r['identical']}/{r['prompts']} | {pct(r['valid'], r['finished'])} | "
                     f"{pct(r['ar_valid'], r['ar_finished'])} | {r['tpf']:.2f} | {r['tpf_free']:.2f} | {r['tpf_ar']:.2f} | "
                     f"{r['tps']:.1f} | {r['tps_ar']:.1f} | {r['speedup']:.2f}x |{forced} {r['forceable']:.1f} | "
                     f"{100 * r['grammar_share']:.1f} % | {100 * r['shaping_share']:.1f} % |")
    if lp:
        lines += ["", "logprobs (k = 5, no grammar, batch 1): lossless vs AR", "",
                  "| model | prompts | tokens compared | max abs delta (token) | max abs delta (top-5, by id) | "
                  "top-5 ids equal | max abs delta, weights in float64 (20 prompts) |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['prompts']} | {r['note']} | | | | |" if "note" in r else
                  f"| {r['model']} | {r['prompts']} | {r['tokens']} | {r['max_delta']:.2e} | {r['max_delta_top']:.2e} | "
                  f"{r['same_top']}/{r['tokens']} | {r['max_delta_float64']:.2e} |" for r in lp]
    differ = [r for r in rows if r["differ"]]
    if differ:
        lines += ["", "Prompts (index) whose ids differ from constrained AR's:", ""]
        lines += [f"- {r['model']} / {r['schema']}: {', '.join(map(str, r['differ'][:20]))}" for r in differ]
    lines += ["", "Forced per row (decoder): the forced tokens its statistics report, where they do; forceable: tokens "
              "where the grammar "
              "allowed exactly one id, replayed over the lossless output. Grammar share: wall seconds in the matcher "
              "methods, matcher copies and mask unpacking / the timed decode calls' wall seconds; shaping share: the verify "
              "batch's whole per-step shaping (verify/shaped.py's Shaping methods: drafts rebuilt, masks filled and "
              "applied, logprob columns, matchers advanced), the grammar work included.", "",
              "| where | target | measured | met |", "|---|---|---|---|"]
    lines += [f"| {w} | {t} | {m} | {'PASS' if ok else 'MISS'} |" for w, t, m, ok in checks]
    return "\n".join(lines) + "\n"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run, about 2 minutes: 6 prompts (SmolLM2: 2), "
                   "64 new tokens, logprobs on 4 prompts")
    p.add_argument("--only", choices=("stories", "smollm2", "logprobs"), help="run one part only")
    p.add_argument("--out", type=Path, default=RESULTS, help="the markdown report (default %(default)s)")
    p.add_argument("--prompts", type=int, default=100, help="story openings of parts 1 and 3")
    p.add_argument("--smollm2-prompts", type=int, default=20, help=f"at most {len(SUBJECTS)}")
    p.add_argument("--logprob-prompts", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="batch size of the grammar-share run")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.smollm2_prompts, args.logprob_prompts = min(args.prompts, 6), min(args.smollm2_prompts, 2), \
            min(args.logprob_prompts, 4)
        args.max_new_tokens = min(args.max_new_tokens, 64)
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0, load_start = time.perf_counter(), load_average()
    print(f"load average {load_start}", flush=True)
    parts = {}

    def part(name, fn):
        if args.only not in (None, name):
            return []
        t = time.perf_counter()
        got = fn(args)
        parts[name] = time.perf_counter() - t
        print(f"{name}: {parts[name]:.0f} s, load average {load_average()}", flush=True)
        return got
    rows = part("stories", stories) + part("smollm2", smollm2)
    lp = part("logprobs", logprobs)
    import llguidance

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "quick": args.quick,
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "llguidance": getattr(llguidance, "__version__", "?"), "load_start": load_start, "load_end": load_average(),
           "seconds": time.perf_counter() - t0, "parts": parts, "max_new_tokens": args.max_new_tokens, "batch": args.batch,
           "argv": " ".join(sys.argv[1:] if argv is None else argv)}
    report = markdown(rows, lp, targets(rows, lp, args.batch), env)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, report)
    return rows, lp


if __name__ == "__main__":
    main()
