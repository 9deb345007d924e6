"""MultiTF on stories260K: the control runs that separate the recipe from the model's capacity (issue 29).

From the shipped ``stories260K-bd``, four post-trainings of the same step budget and the same
training rows per step (``--rows``, layouts included), one after another on one thread:

    a  control: plain TF continued (the bd recipe's objective: i.i.d. t per block, stochastic
       rounding) at the MultiTF lr and steps, so generic drift of more training shows on its own
    b  official-exact MultiTF: floor rounding, all |Λ| = 11 layouts per clean row (G_max 4,
       N_rand 2, the SDAR-b4 row), mean masked CE, lr 5e-4 (the shipped recipe's lr)
    c  as b with G_max 2 (the LLaDA2 setting: N_rand 0, |Λ| = 2), decoded with --slots 2
    d  as b with lr 1e-4

Each model (and ``stories260K-bd`` itself, the training-free baseline) is scored by
``benchmarks/multiblock.py``'s decode and judge on the same story openings (reference NLL of the
continuation under the causal stories260K, TPF of SingleBD threshold decoding and of the Block
Buffer), and by its **held-out masked NLL by slot**: the validation split of the corpus, one fixed
draw of MultiTF batches (G_max 4, every systematic layout, floor rounding, the same for every
model), mean NLL of the masked tokens grouped by the block's slot in its noise group (slot 0 sees
the clean prefix only, as in plain TF; slot s >= 1 sees s noisy predecessors).

    python benchmarks/multitf_controls.py --steps 150 [--runs a,b,c,d] [--train-only | --score-only]

Trained models and their scores are kept under ``--work-dir`` (runs/ is not in git); a run whose
model exists is not retrained, a model already scored at these settings is not rescored. Writes ``benchmarks/results/multitf_controls.{md,json}`` after scoring.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "recipes"))
import multiblock as mb  # noqa: E402  (decode + judge of the MBD benchmark)
import stories260K_bd as bd  # noqa: E402  (the corpus the bd / mbd recipes train on)

LR = 5e-4
RUNS = {
    "a": {"what": "control: plain TF continued (stochastic, i.i.d. t)", "kind": "tf", "lr": LR, "slots": 4},
    "b": {"what": "official-exact MultiTF (floor, all 11 layouts, CE, G_max 4)", "kind": "multitf", "lr": LR,
          "g_max": 4, "n_rand": 2, "slots": 4},
    "c": {"what": "MultiTF G_max 2 (LLaDA2: N_rand 0, 2 layouts), --slots 2", "kind": "multitf", "lr": LR,
          "g_max": 2, "n_rand": 0, "slots": 2},
    "d": {"what": "official-exact MultiTF at lr 1e-4", "kind": "multitf", "lr": 1e-4, "g_max": 4, "n_rand": 2,
          "slots": 4},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps of every run (the same budget)")
    p.add_argument("--rows", type=int, default=22, help="training rows per step (clean rows x layouts)")
    p.add_argument("--runs", default="a,b,c,d", help="comma-separated subset of a, b, c, d")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "multitf_controls")
    p.add_argument("--corpus", type=Path, default=bd.SHARED_CORPUS)
    p.add_argument("--seq-len", type=int, default=288)
    p.add_argument("--limit", type=int, default=100, help="story openings decoded per configuration")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--val-rows", type=int, default=48, help="held-out rows of the masked-NLL-by-slot probe")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--train-only", action="store_true")
    p.add_argument("--score-only", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "multitf_controls")
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in args.runs if r not in RUNS]
    if bad:
        p.error(f"unknown run(s) {bad}; choose from {', '.join(RUNS)}")
    if args.steps < 1 or args.rows < 1:
        p.error("--steps and --rows must be >= 1")
    return args


def clean_rows(spec: dict, rows: int) -> int:
    """Clean rows per step so that a step sees about ``rows`` training rows (layouts included)."""
    if spec["kind"] == "tf":
        return rows
    n_layouts = (spec["g_max"] + 2) * (spec["g_max"] - 1) // 2 + spec["n_rand"]
    return max(1, round(rows / n_layouts))


def train_run(name: str, args) -> Path:
    """Train run ``name`` unless its model exists; returns the model directory."""
    from unmask.train.block_diffusion import train_block_diffusion
    from unmask.train.multitf import train_multitf

    spec = RUNS[name]
    out = args.work_dir / name / "model"
    if (out / "config.json").is_file():
        bd.log(f"run {name}: model exists at {out}, not retrained")
        return out
    common = dict(base="stories260K-bd", data=[args.corpus], out=out, run_dir=args.work_dir / name / "run",
                  seq_len=args.seq_len, overwrite=True, steps=args.steps, batch_size=clean_rows(spec, args.rows),
                  lr=spec["lr"], warmup=max(1, round(0.03 * args.steps)), weight_decay=0.1, ckpt_every=0,
                  eval_every=0, seed=0, progress=False)
    bd.log(f"run {name} ({spec['what']}): {args.steps} steps of {common['batch_size']} clean rows, lr {spec['lr']}")
    t0 = time.monotonic()
    if spec["kind"] == "tf":
        result = train_block_diffusion(rounding="stochastic", **common)
    else:
        result = train_multitf(g_max=spec["g_max"], n_rand=spec["n_rand"], layouts_per_row=0, rounding="floor",
                               loss="ce", **common)
    minutes = (time.monotonic() - t0) / 60
    (args.work_dir / name / "train.json").write_text(json.dumps(
        {"run": name, **spec, "steps": args.steps, "clean_rows": common["batch_size"], "minutes": minutes,
         "last": result.last, "stopped": result.stopped}, indent=2, default=float) + "\n")
    bd.log(f"run {name}: done in {minutes:.1f} min, last {result.last}")
    if result.out is None:
        raise SystemExit(f"run {name} did not finish ({result.stopped})")
    return out


def held_out_rows(args, bundle) -> torch.Tensor:
    """The validation split the training runs held out (same split and packing): (M, L+1)."""
    from unmask.train.block_diffusion import pack_aligned
    from unmask.train.wiring import load_chunks

    vocab = bundle.model.get_input_embeddings().weight.shape[0]
    _, val = load_chunks([args.corpus], bundle.tokenizer, vocab, pack_aligned, args.seq_len, need=args.seq_len + 1,
                         val_fraction=0.05, seed=0, config=bundle.model.config)
    return val[: args.val_rows]


@torch.no_grad()
def nll_by_slot(bundle, rows: torch.Tensor, g_max: int = 4, seed: int = 1234) -> dict:
    """Held-out masked NLL (nats) by slot in the noise group, on one fixed MultiTF draw.

    rows (M, L+1) -> {"slot 0": mean NLL, ..., "count": {...}}: every systematic layout of G_max
    (no random ones, so every slot occurs at every block), floor rounding, chain-uniform noise.
    """
    from unmask.compat import attention_mask, forward
    from unmask.masks import as_4d
    from unmask.train.block_diffusion import IGNORE
    from unmask.train.multitf import MultiTFObjective

    model = bundle.model.eval()
    obj = MultiTFObjective(mask_token_id=bundle.mask_token_id, block_size=bundle.block_size, g_max=g_max, n_rand=0)
    g = torch.Generator().manual_seed(seed)
    sums, counts = torch.zeros(g_max, dtype=torch.float64), torch.zeros(g_max, dtype=torch.long)
    B = bundle.block_size
    for chunk in rows.split(2):  # (2, L+1): 2 clean rows x 9 layouts per forward
        batch = obj.batch(chunk, g)
        N, L = batch["labels"].shape
        logits = forward(model, batch["input_ids"], position_ids=batch["position_ids"],
                         attention_mask=attention_mask(model, as_4d(batch["attention"], N)),
                         logits_to_keep=torch.arange(L))  # (N, L, V)
        logits[..., bundle.mask_token_id] = float("-inf")
        labels = batch["labels"]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1),
                                                reduction="none").view(N, L)  # (N, L)
        groups = batch["groups"]  # (N, K)
        starts = torch.ones_like(groups, dtype=torch.bool)
        starts[:, 1:] = groups[:, 1:] != groups[:, :-1]  # (N, K) first block of its group
        first = torch.cummax(torch.where(starts, torch.arange(groups.shape[1]).expand_as(groups), 0), dim=1).values
        slot = (torch.arange(groups.shape[1]) - first).repeat_interleave(B, dim=1)  # (N, L) slot of each position
        valid = labels != IGNORE
        for s in range(g_max):
            keep = valid & (slot == s)
            sums[s] += nll[keep].double().sum()
            counts[s] += int(keep.sum())
    out = {f"slot {s}": float(sums[s] / max(1, int(counts[s]))) for s in range(g_max)}
    out["all"] = float(sums.sum() / max(1, int(counts.sum())))
    out["count"] = {f"slot {s}": int(counts[s]) for s in range(g_max)}
    return out


def decode_scores(bundle, judge, prompts: list[str], slots: int, args) -> dict:
    """SingleBD (threshold τ 0.95) and Block Buffer (``slots``) rows of benchmarks/multiblock.py."""
    opts = argparse.Namespace(slots=slots, tau=0.95, tau_add=0.1, tau_semi=0.9, batch_size=1,
                              max_new_tokens=args.max_new_tokens)
    out = {}
    for decoder in ("block", "multiblock"):
        row = mb.run_config(bundle, decoder, prompts, opts)
        mb.score(row, judge)
        out[decoder] = {k: v for k, v in row.items() if k not in ("tokens", "prompt_ids", "options")}
    out["tpf_ratio"] = out["multiblock"]["tpf"] / out["block"]["tpf"]
    return out


def score_all(args) -> dict:
    import unmask

    judge = unmask.load("stories260K")
    prompts = list(mb.STORY_OPENINGS[: args.limit])
    base = unmask.load("stories260K-bd")
    val = held_out_rows(args, base)
    models = {"bd": ("stories260K-bd (training-free)", base, sorted({4, *(RUNS[r]["slots"] for r in args.runs)}))}
    for name in args.runs:
        path = args.work_dir / name / "model"
        if (path / "config.json").is_file():
            models[name] = (RUNS[name]["what"], unmask.load(str(path)), [RUNS[name]["slots"]])
    results = {}
    for name, (what, bundle, slot_list) in models.items():
        t0 = time.monotonic()
        cache = args.work_dir / name / f"score-{args.limit}-{args.max_new_tokens}.json"  # one scoring per model
        entry = json.loads(cache.read_text()) if cache.is_file() else {"what": what, "decode": {}}
        if "slot_nll" not in entry:
            entry["slot_nll"] = nll_by_slot(bundle, val)
        for slots in slot_list:
            if str(slots) not in entry["decode"]:
                entry["decode"][str(slots)] = decode_scores(bundle, judge, prompts, slots, args)
        train = args.work_dir / name / "train.json"
        if train.is_file():
            entry["train"] = json.loads(train.read_text())
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(entry, indent=2, default=float) + "\n")
        results[name] = entry
        bd.log(f"scored {name} in {time.monotonic() - t0:.0f} s")
    return results


def report(results: dict, args) -> str:
    base = results["bd"]
    lines = [f"# MultiTF controls on stories260K (issue 29; {args.limit} story openings, {args.max_new_tokens} new "
             f"tokens, greedy, batch 1; {args.threads} thread)", "",
             f"Every run: {args.steps} optimizer steps of ~{args.rows} training rows (L = {args.seq_len}), AdamW "
             "wd 0.1, 3 % warm-up, cosine, from stories260K-bd, on the bd recipe's story corpus.", "",
             "| run | what | slots | SingleBD NLL | SingleBD TPF | multiblock NLL | multiblock TPF | TPF / SingleBD "
             "| Δ multiblock NLL vs training-free |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in results.items():
        for slots, d in e["decode"].items():
            free = base["decode"].get(slots, base["decode"]["4"])["multiblock"]["nll"]
            delta = 100 * (d["multiblock"]["nll"] - free) / free
            lines.append(f"| {name} | {e['what']} | {slots} | {d['block']['nll']:.4f} | {d['block']['tpf']:.2f} | "
                         f"{d['multiblock']['nll']:.4f} | {d['multiblock']['tpf']:.2f} | {d['tpf_ratio']:.2f}x | "
                         f"{delta:+.2f} % |")
    lines += ["", "Held-out masked NLL (nats) by slot in the noise group (one fixed G_max 4 draw, floor; slot 0 "
              "sees the clean prefix only, slot s sees s noisy predecessors), and its change vs stories260K-bd:", "",
              "| run | slot 0 | slot 1 | slot 2 | slot 3 | all |", "|---|---:|---:|---:|---:|---:|"]
    keys = ["slot 0", "slot 1", "slot 2", "slot 3", "all"]
    for name, e in results.items():
        cells = []
        for k in keys:
            v, b = e["slot_nll"][k], base["slot_nll"][k]
            cells.append(f"{v:.4f}" if name == "bd" else f"{v:.4f} ({100 * (v - b) / b:+.1f} %)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Training (final logged step):", "", "| run | clean rows / step | minutes | last train terms |",
              "|---|---:|---:|---|"]
    for name, e in results.items():
        t = e.get("train")
        if t:
            last = ", ".join(f"{k} {v:.4f}" for k, v in (t.get("last") or {}).items() if isinstance(v, (int, float)))
            lines.append(f"| {name} | {t['clean_rows']} | {t['minutes']:.1f} | {last} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from unmask.compat import quiet_transformers

    quiet_transformers()
    if not args.corpus.is_file():
        print(f"error: no corpus at {args.corpus}; run recipes/stories260K_bd.py once (it builds it) or pass "
              "--corpus", file=sys.stderr)
        return 2
    if not args.score_only:
        for name in args.runs:
            train_run(name, args)
    if args.train_only:
        return 0
    results = score_all(args)
    text = report(results, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "results": results}, indent=2, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
