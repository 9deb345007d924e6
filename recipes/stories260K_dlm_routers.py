"""Train the Early-Bird routers (LBS + LPS) of the shipped ``stories260K-dlm`` (spec/early_bird.md §3–§4).

    python recipes/stories260K_dlm_routers.py                # default budget: 45 minutes on 2 CPU cores
    python recipes/stories260K_dlm_routers.py --smoke        # ~3 min end-to-end check on a stand-in, under WORK/smoke
    python recipes/stories260K_dlm_routers.py --minutes 90   # more responses, traces and epochs (hard cap 120)

Steps, each bounded by its share of ``--minutes`` (unused time rolls over to the next):

1. **LBS data** (30 %). Prompts are BOS + the first 4–24 tokens of documents of the story corpus
   (``--corpus``, default the shared ``runs/stories260K_sbd/corpus-s2400-g5600-t320-seed0.jsonl``);
   responses are the model's own greedy outputs at L = ``--gen-length`` (256), EOS-padded to L.
   Our choice for the CPU budget: Fast-dLLM threshold decoding (τ = 0.9, L_B = 32) with the dual
   cache instead of the spec's vanilla 1-token-per-step uncached decode (``--responses top-k
   --response-cache none`` restores it); about five times more responses fit the slice.
2. **LBS training** (15 %). Alg. 3 (Blockwise-Masking resampled every epoch, Eq. 3 loss), AdamW,
   cosine without warm-up, batch 32; the epoch count is fitted to the slice from a timing of one
   batch. lr 5e-4 (the paper's 5e-5 assumes ~17k steps on 92k prompts; we get far fewer).
3. **LPS traces** (30 %). Early-Bird decoding with the trained LBS and the threshold rule (no LPS,
   no cache) under the serving configuration L, L_B = 32, τ = 0.9, L_min = 8, g_max = 5, on prompts
   disjoint from the LBS ones; labels y = 1[x̂_t = x_0] attached to the recorded features.
4. **LPS training** (15 %). Trace-level 80/10/10 split (seed 42), weighted BCE (w⁻ = 2), AdamW
   lr 1e-3, batches of 512 step records, τ_ψ = largest validation recall at FPR ≤ 1 % on
   linspace(0.8, 0.9999, 250), early stopping (patience 100) or the slice; recall / FPR on the
   test split are logged and stored in ``lps.json``.

Router sizes (config fields; the CLI exposes them too): LBS d = 32, 1 encoder layer, FFN 64
(~19k parameters besides the frozen embedding); LPS d = 32, 1 pre-norm block, FFN 64. Both are
small next to stories260K-dlm (dim 64, 5 layers), so their share of step time stays low; the
benchmark (``benchmarks/early_bird.py``) measures it.

Responses are cached under ``--work-dir`` (keyed by the model's embedding fingerprint and the
settings), so a rerun skips them; the traces are saved there too (for inspection or
``unmask train lps --traces-file``; they depend on the LBS router). The two routers are written to a staging directory and
published atomically as ``MODEL_DIR/routers/`` (``src/unmask/checkpoints/stories260K-dlm/routers``);
rebuilding stories260K-dlm itself replaces that directory, so rerun this recipe afterwards.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
HARD_CAP_MINUTES = 120
SHARED_CORPUS = REPO / "runs" / "stories260K_sbd" / "corpus-s2400-g5600-t320-seed0.jsonl"
SHARES = {"responses": 0.30, "lbs": 0.15, "traces": 0.30, "lps": 0.15}  # the rest: check + publish


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="stories260K-dlm", help="masked-diffusion model: shipped name or directory")
    p.add_argument("--minutes", type=float, default=45.0, help=f"budget of the whole recipe (max {HARD_CAP_MINUTES})")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "stories260K_dlm_routers")
    p.add_argument("--out", type=Path, default=None, help="router directory (default MODEL_DIR/routers)")
    p.add_argument("--corpus", type=Path, default=None, help=f"prompt corpus (default {SHARED_CORPUS})")
    p.add_argument("--gen-length", type=int, default=256, help="L: LBS works at this length only")
    p.add_argument("--block-size", type=int, default=32, help="L_B")
    p.add_argument("--tau", type=float, default=0.9)
    p.add_argument("--l-min", type=int, default=8)
    p.add_argument("--g-max", type=int, default=5)
    p.add_argument("--lbs-prompts", type=int, default=2000, help="upper bound; the time slice decides")
    p.add_argument("--lps-prompts", type=int, default=1500, help="upper bound; the time slice decides")
    p.add_argument("--responses", choices=("threshold", "top-k"), default="threshold")
    p.add_argument("--response-cache", choices=("none", "prefix", "dual"), default="dual")
    p.add_argument("--gen-batch", type=int, default=8, help="rows per response / trace decode (small: fine budget steps)")
    p.add_argument("--lbs-lr", type=float, default=5e-4)
    p.add_argument("--lbs-loss", choices=("eq3", "bce"), default="eq3",
                   help="eq3: the paper's Eq. 3; bce: BCE against its minimiser 1[CE < 1] (Eq. 3 collapses to "
                        "p_φ ≈ 0 here, see unmask.train.routers)")
    p.add_argument("--lbs-d", type=int, default=32)
    p.add_argument("--lbs-layers", type=int, default=1)
    p.add_argument("--lps-d", type=int, default=32)
    p.add_argument("--lps-layers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="stand-in model (stories260K + a mask token), L = 64, ~3 min")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= HARD_CAP_MINUTES:
        p.error(f"--minutes must be in (0, {HARD_CAP_MINUTES}]")
    if args.smoke:
        args.work_dir = args.work_dir / "smoke"
        args.gen_length, args.block_size, args.l_min = 64, 16, 4
        args.lbs_prompts, args.lps_prompts, args.gen_batch = 24, 24, 8
        args.minutes = min(args.minutes, 4)
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stand_in(work: Path) -> Path:
    """stories260K with an added mask token (id 512), saved as a masked-diffusion directory with
    logit shift 1: the shapes of stories260K-dlm, untrained for diffusion (smoke runs only)."""
    import unmask
    from unmask.models.mask_token import add_mask_token

    d = work / "stand-in"
    if (d / "unmask_config.json").is_file():
        return d
    bundle = unmask.load("stories260K")
    mask = add_mask_token(bundle.model)
    bundle.model.save_pretrained(d)
    bundle.tokenizer.save_pretrained(d)
    (d / "unmask_config.json").write_text(json.dumps({"kind": "masked-diffusion", "mask_token_id": mask,
                                                      "logit_shift": 1, "stop_token_ids": [2, 1]}))
    return d


def prompt_corpus(args, bundle) -> list[Path]:
    corpus = args.corpus or (SHARED_CORPUS if SHARED_CORPUS.is_file() else None)
    if corpus is not None:
        return [corpus]
    if not args.smoke:
        raise SystemExit(f"no prompt corpus: {SHARED_CORPUS} is missing; run recipes/stories260K_sbd.py first "
                         "or pass --corpus FILE")
    from unmask.eval.story_openings import STORY_OPENINGS

    path = args.work_dir / "openings.jsonl"  # smoke only: the 20 openings the benchmark does not use
    path.write_text("".join(json.dumps({"ids": bundle.encode(t)[1:]}) + "\n" for t in STORY_OPENINGS[100:]))
    return [path]


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    budget = 60 * args.minutes
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)

    import unmask
    from unmask.compat import quiet_transformers
    from unmask.errors import one_line_warnings
    from unmask.fileio import atomic_write_json, publish_dir, staging_dir
    from unmask.routers.io import embedding_fingerprint, routers_dir
    from unmask.train import routers as tr

    quiet_transformers()
    one_line_warnings()  # "warning: ..." as the command line prints it, not Python's source echo
    model = str(stand_in(args.work_dir)) if args.smoke else args.model
    bundle = unmask.load(model)
    out = args.out or routers_dir(bundle)
    if out is None:
        raise SystemExit("the model has no directory; pass --out")
    data = prompt_corpus(args, bundle)
    vocab = bundle.model.get_input_embeddings().weight.shape[0]
    key = f"{embedding_fingerprint(bundle.model)}-L{args.gen_length}-B{args.block_size}"
    deadline = {}
    acc = 0.0
    for name, share in SHARES.items():
        acc += share
        deadline[name] = t_start + acc * budget

    def left(name: str) -> float:
        return max(0.5, (deadline[name] - time.monotonic()) / 60)

    log(f"model {bundle.name} ({vocab} tokens), L {args.gen_length}, L_B {args.block_size}, budget {args.minutes} min, "
        f"out {out}")

    # 1. LBS data: the model's own responses (cached).
    resp_file = args.work_dir / f"responses-{key}-{args.responses}-{args.response_cache}.json"
    lbs_prompts = tr.prompts_from_corpus(data, min(args.lbs_prompts, _n_docs(data, vocab)), bos=bundle.bos_token_id,
                                         seed=args.seed, vocab_size=vocab)
    cached = json.loads(resp_file.read_text()) if resp_file.is_file() else []
    todo = lbs_prompts[len(cached):]
    if todo and time.monotonic() < deadline["responses"]:
        log(f"responses: {len(cached)} cached, generating up to {len(todo)} more ({left('responses'):.1f} min)")
        new = tr.generate_responses(bundle, todo, gen_length=args.gen_length, block_size=args.block_size,
                                    policy=args.responses, tau=args.tau, cache=args.response_cache,
                                    batch_size=args.gen_batch,
                                    max_minutes=left("responses"), progress=log)
        cached += new
        atomic_write_json(resp_file, cached)
    responses = cached
    lbs_prompts = lbs_prompts[: len(responses)]
    log(f"responses: {len(responses)}")

    # 2. LBS training, epochs fitted to the slice.
    per_batch = _time_lbs_batch(bundle, lbs_prompts, responses, args)
    n_batches = max(1, -(-int(0.95 * len(responses)) // 32))
    epochs = max(1, min(300, int(0.9 * left("lbs") * 60 / (per_batch * n_batches * 1.1))))
    log(f"LBS: {per_batch:.2f} s/batch, {n_batches} batches/epoch -> {epochs} epochs")
    emb = bundle.model.get_input_embeddings().weight
    lbs_cfg = tr.LBSConfig(gen_length=args.gen_length, d_base=int(emb.shape[1]), vocab_size=int(emb.shape[0]),
                           d=args.lbs_d, layers=args.lbs_layers, ffn=2 * args.lbs_d)
    lbs, lbs_report = tr.train_lbs(bundle, lbs_prompts, responses,
                                   tr.LBSTrainConfig(block=args.block_size, epochs=epochs, lr=args.lbs_lr,
                                                     seed=args.seed, max_minutes=left("lbs"), loss=args.lbs_loss),
                                   lbs_cfg, progress=log)
    lbs_report.update(prompts=len(lbs_prompts), response_policy=args.responses, response_cache=args.response_cache,
                      gen_length=args.gen_length)

    # 3. LPS traces under the serving configuration (cached per LBS router).
    serving = {"block_size": args.block_size, "tau": args.tau, "l_min": args.l_min, "g_max": args.g_max}
    lps_prompts = tr.prompts_from_corpus(data, min(args.lps_prompts, _n_docs(data, vocab) - len(lbs_prompts)),
                                         bos=bundle.bos_token_id, seed=args.seed, from_end=True, vocab_size=vocab)
    traces = tr.collect_lps_traces(bundle, lbs, lps_prompts, batch_size=args.gen_batch, max_minutes=left("traces"),
                                   progress=log, **serving)
    traces.save(args.work_dir / f"traces-{key}.pt")
    log(f"traces: {traces.n_traces} traces, {traces.n_records} step records, "
        f"{traces.labels.float().mean():.1%} positive labels")

    # 4. LPS training.
    lps, tau_psi, lps_report = tr.train_lps(
        traces, tr.LPSTrainConfig(max_minutes=left("lps"), seed=42),
        tr.LPSConfig(d=args.lps_d, layers=args.lps_layers, ffn=2 * args.lps_d), progress=_every(log, 10))
    lps_report["traces"] = traces.meta
    log(f"LPS: τψ {tau_psi:.4f}; val recall {lps_report['val']['recall']:.3f} at FPR {lps_report['val']['fpr']:.4f}; "
        f"test recall {lps_report['test']['recall']:.3f} at FPR {lps_report['test']['fpr']:.4f}")

    # Publish both routers at once, then a short check decode through the published files.
    stage = staging_dir(Path(out))
    tr.save_lbs(lbs, bundle, stage, lbs_report)
    tr.save_lps(lps, tau_psi, bundle, stage, lps_report, serving)
    publish_dir(stage, Path(out))
    check = _check(bundle, out, args)
    summary = {"model": bundle.name, "out": str(out), "minutes": (time.monotonic() - t_start) / 60,
               "lbs": {"params": lbs.n_params(), "epochs": lbs_report["epochs"], "responses": len(responses),
                       "train_loss": lbs_report["train_loss"][-1:], "val_loss": lbs_report["val_loss"][-1:]},
               "lps": {"params": lps.n_params(), "tau_psi": tau_psi, "traces": traces.n_traces,
                       "records": traces.n_records, "val": lps_report["val"], "test": lps_report["test"],
                       "epochs": lps_report["epochs"], "stopped": lps_report["stopped"]},
               "check": check}
    atomic_write_json(args.work_dir / "summary.json", summary)
    log(f"done: {json.dumps(summary)}")
    return 0


def _n_docs(data, vocab) -> int:
    from unmask.train.data import read_documents

    return sum(1 for p in data for r in read_documents(p, vocab_size=vocab) if len(r["ids"]) >= 2)


def _time_lbs_batch(bundle, prompts, responses, args) -> float:
    """Seconds of one LBS training batch (frozen forward + router step), from two timed batches."""
    from unmask.train import routers as tr

    n = min(len(prompts), 64)
    t0 = time.perf_counter()
    tr.train_lbs(bundle, prompts[:n], responses[:n], tr.LBSTrainConfig(block=args.block_size, epochs=1,
                                                                       val_fraction=0.0))
    return (time.perf_counter() - t0) / max(1, -(-n // 32))


def _every(fn, k: int):
    """Pass every k-th message on (the LPS loop logs one line per epoch)."""
    count = {"n": 0}

    def call(msg: str) -> None:
        count["n"] += 1
        if count["n"] % k == 1:
            fn(msg)
    return call


def _check(bundle, out, args) -> dict:
    """Three story openings through the published routers: TPF of LBS+LPS, LBS only and threshold."""
    from unmask.decode import DECODERS
    from unmask.eval.story_openings import STORY_OPENINGS

    prompts = [bundle.encode(p) for p in STORY_OPENINGS[100:103]]
    res = {}
    runs = {"lbs+lps": lambda: DECODERS["early-bird"].decode(bundle, prompts, max_new_tokens=args.gen_length, routers=out,
                                                 stop_token_ids=bundle.stop_token_ids),
            "lbs": lambda: DECODERS["early-bird"].decode(bundle, prompts, max_new_tokens=args.gen_length, routers=out, lps=False,
                                             stop_token_ids=bundle.stop_token_ids, block_size=args.block_size,
                                             tau=args.tau, l_min=args.l_min, g_max=args.g_max),
            "threshold": lambda: DECODERS["diffusion"].decode(bundle, prompts, max_new_tokens=args.gen_length,
                                                  gen_length=args.gen_length, block_size=args.block_size,
                                                  policy="threshold", tau=args.tau,
                                                  stop_token_ids=bundle.stop_token_ids)}
    for name, fn in runs.items():
        s = fn().stats
        res[name] = {"tpf": round(s.tpf, 3), "nfe": s.nfe, "router_share": round(s.extra.get("router_share", 0.0), 3)}
        log(f"check {name}: TPF {s.tpf:.2f}, NFE {s.nfe}" + (f", router share {s.extra['router_share']:.1%}"
                                                             if "router_share" in s.extra else ""))
    return res


if __name__ == "__main__":
    sys.exit(main())
