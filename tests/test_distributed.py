"""Scale-out on torch.distributed (docs/scaling.md): 2 gloo processes on CPU, spawned by the tests
(tests/ranks.py), against one process.

Training: a DDP step equals one process on the same global batch; FSDP2 checkpoints (DCP)
resume on one process; the CLI publishes from rank 0 only. Evaluation and generation: data
parallel rows equal one process, in order. Decoding: ``--tp 2`` through transformers'
tp_plan="auto" gives one process's tokens. Nothing here needs CUDA; NCCL and bf16 FSDP2 mixed
precision are the only paths not run (they need GPUs).
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from conftest import ids_file, one_line_error, tiny_llama, with_mask_row
from ranks import run_ranks
from unmask.errors import UnmaskError
from unmask.train.loop import TrainConfig, latest_checkpoint, train
from unmask.train.objectives import SBDObjective

VOCAB, MASK = 64, 64
CFG = TrainConfig(lr=1e-2, warmup=0, min_lr_ratio=1.0, steps=3, batch_size=2, grad_accum=1, ckpt_every=0,
                  eval_every=0, log_every=1, clip=1.0, weight_decay=0.1)


def _chunks() -> torch.Tensor:
    return torch.randint(3, VOCAB, (16, 17), generator=torch.Generator().manual_seed(0))  # (16, L+1)


def _train(run_dir, cfg: TrainConfig, resume: bool = False, device: str = "cpu") -> dict:
    model = with_mask_row(tiny_llama(vocab=VOCAB))
    result = train(model, SBDObjective(MASK, block_range=(2, 4)), _chunks(), _chunks()[:4], cfg, run_dir,
                   resume=resume, device=device)
    assert result.stopped == "done", result
    from unmask.train.parallel import full_state_dict

    full = full_state_dict(model)  # a collective under FSDP2; None off rank 0
    full = None if full is None else {k: v.detach().cpu() for k, v in full.items()}
    from unmask import dist

    return {"rank": dist.rank(), "world": dist.world(), "params": full, "val": result.val}


def _objective(name: str):
    from unmask.train.block_diffusion import TFObjective
    from unmask.train.diffusion import MaskedDiffusionObjective
    from unmask.train.multitf import MultiTFObjective

    return {"diffusion": MaskedDiffusionObjective(mask_token_id=MASK),
            "block-diffusion": TFObjective(mask_token_id=MASK, block_size=4),
            "multitf": MultiTFObjective(mask_token_id=MASK, block_size=4, g_max=2, n_rand=1)}[name]


def _train_objective(name: str, run_dir, cfg: TrainConfig) -> dict | None:
    model = with_mask_row(tiny_llama(vocab=VOCAB))
    train(model, _objective(name), _chunks(), None, cfg, run_dir)
    from unmask.train.parallel import full_state_dict

    return full_state_dict(model)


def _train_on_rank_data(run_dir) -> str:
    """Rank 1 packs one row fewer than rank 0, as a node with another copy of the corpus would."""
    from unmask import dist

    chunks = _chunks() if dist.env_rank() == 0 else _chunks()[:-1]
    try:
        train(with_mask_row(tiny_llama(vocab=VOCAB)), SBDObjective(MASK), chunks, None, CFG, run_dir)
    except UnmaskError as e:
        return str(e)
    return "trained"


def test_ranks_with_different_data_are_refused_on_every_rank(tmp_path):
    errors = run_ranks(_train_on_rank_data, tmp_path)
    assert all("packed different training data" in e for e in errors), errors
    assert not (tmp_path / "checkpoints").exists()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_ddp_step_equals_one_process_on_the_same_global_batch(tmp_path):
    # 2 processes x grad_accum 1 == 1 process x grad_accum 2: the same micro-batches, the same
    # noise (generators seeded by seed, step and micro-batch), gradients averaged the same way.
    single = _train(tmp_path / "one", replace(CFG, grad_accum=2))["params"]
    ranks = run_ranks(_train, tmp_path / "ddp", CFG)
    assert [r["world"] for r in ranks] == [2, 2] and ranks[1]["params"] is None
    assert _max_diff(ranks[0]["params"], single) <= 1e-6
    assert ranks[0]["val"] == ranks[1]["val"]  # every rank scores the same validation rows
    smaller = _train(tmp_path / "half", CFG)["params"]  # one process with half the batch differs
    assert _max_diff(smaller, single) > 1e-4
    logged = [json.loads(line) for line in (tmp_path / "ddp" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "lr" in r] == [1, 2, 3]  # rank 0 alone writes the log
    assert all(r["world"] == 2 for r in logged if "lr" in r)


@pytest.mark.parametrize("name", ["diffusion", "block-diffusion", "multitf"])
def test_every_loop_objective_trains_data_parallel_like_one_process(tmp_path, name):
    cfg = replace(CFG, steps=2)
    single = _train_objective(name, tmp_path / "one", replace(cfg, grad_accum=2))
    ranks = run_ranks(_train_objective, name, tmp_path / "ddp", cfg)
    assert _max_diff(ranks[0], single) <= 1e-6


def test_fsdp_checkpoint_resumes_on_one_process(tmp_path):
    # FSDP2 on 2 ranks x grad_accum 2 for 2 steps; the DCP checkpoint resumes on 1 process with
    # the same micro-batches per step (grad_accum 4) and ends where 4 straight steps end.
    fsdp = replace(CFG, steps=2, grad_accum=2, ckpt_every=2, fsdp=True)
    ranks = run_ranks(_train, tmp_path / "run", fsdp)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "step-00000002"
    assert sorted(p.name for p in (ckpt / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    two_steps = _train(tmp_path / "two", replace(CFG, steps=2, grad_accum=4))["params"]
    # FSDP2's reduce-scatter sums the micro-batch gradients in another order than accumulation in
    # one process; Adam divides by sqrt(v), so a rounding-level gradient difference on a weight
    # with a near-zero gradient moves it by up to ~lr x 1e-2 (measured 1.1e-5 on some CPUs, 0 on
    # others). A lost or repeated micro-batch moves weights by > 1e-4 (the DDP test above).
    tol = 5e-5
    assert _max_diff(ranks[0]["params"], two_steps) <= tol  # the gathered FSDP2 weights
    exported = load_file(str(ckpt / "model.safetensors"))  # the HF export of the checkpoint
    assert _max_diff({k: exported[k] for k in exported}, {k: ranks[0]["params"][k] for k in exported}) <= 1e-6

    with pytest.raises(UnmaskError, match=r"2 process\(es\) x --grad-accum 2 = 4 micro-batches.*--grad-accum 4"):
        _train(tmp_path / "run", replace(CFG, steps=4, grad_accum=2), resume=True)
    resumed = _train(tmp_path / "run", replace(CFG, steps=4, grad_accum=4), resume=True)["params"]
    straight = _train(tmp_path / "straight", replace(CFG, steps=4, grad_accum=4))["params"]
    assert _max_diff(resumed, straight) <= tol


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL and FSDP2 bf16 mixed precision need 2 CUDA devices")
def test_nccl_ddp_and_bf16_fsdp_on_two_gpus(tmp_path):
    cfg = replace(CFG, lr=1e-3)
    single = _train(tmp_path / "one", replace(cfg, grad_accum=2), device="cuda")["params"]
    ddp = run_ranks(_train, tmp_path / "ddp", cfg, False, "cuda", start="spawn")
    assert _max_diff(ddp[0]["params"], single) <= 1e-5  # fp32 on both sides
    fsdp = run_ranks(_train, tmp_path / "fsdp", replace(cfg, fsdp=True), False, "cuda", start="spawn")
    # bf16 compute moves each AdamW update by at most ~2 lr; the run must train and publish
    assert _max_diff(fsdp[0]["params"], single) <= 2 * cfg.lr * cfg.steps + 1e-6
    assert latest_checkpoint(tmp_path / "fsdp").name == "step-00000003"


def _cli(argv: list[str]) -> tuple[int, str]:
    from unmask.cli import main

    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue()


def test_cli_train_under_two_processes_publishes_from_rank_0(tmp_path):
    data = ids_file(tmp_path / "d.jsonl")
    argv = ["train", "sbd", "--base", "stories260K", "--data", str(data), "--seq-len", "32", "--steps", "2",
            "--batch-size", "2", "--warmup", "1", "--ckpt-every", "0", "--eval-every", "0"]
    (tmp_path / "out").mkdir()  # an earlier model: --overwrite replaces it, cleared by rank 0 alone
    ranks = run_ranks(_cli, argv + ["--out", str(tmp_path / "out"), "--overwrite", "--fsdp"])
    assert [code for code, _ in ranks] == [0, 0]
    assert ranks[0][1].startswith(f"wrote {tmp_path / 'out'} after 2 steps") and ranks[1][1] == ""
    code, _ = _cli(argv + ["--out", str(tmp_path / "one"), "--grad-accum", "2"])
    assert code == 0
    a, b = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(tmp_path / "one" / "model.safetensors"))
    # FSDP2 reduce-scatters in another summation order and AdamW magnifies the last-bit gradient
    # differences of near-zero gradients (update ~ lr · g / |g|): 1e-5 at lr 3e-4, the benchmark's bound.
    assert _max_diff(a, b) <= 1e-5


# ---------------------------------------------------------------------------------------------
# Data-parallel evaluation and generation
# ---------------------------------------------------------------------------------------------

SAME = ("id", "prompt", "text", "n_tokens", "nfe", "tpf", "batch", "nll", "judge_prob_pct", "distinct_4",
        "agreement_prefix", "agreement_positional")


def _eval(**kw) -> list[dict]:
    from unmask.eval.runner import evaluate

    res = evaluate("stories", "stories260K-sbd", "sbd", limit=5, batch_size=2, max_new_tokens=12, warmup=False,
                   temperature=0.8, seed=3, **kw)
    return [{k: r.get(k) for k in SAME} for r in res.rows] + [{k: res.summary[k] for k in ("n", "generated", "tpf")}]


def test_data_parallel_eval_equals_one_process_in_order():
    # Batches are dealt to the ranks whole, with the same seeded generator: even sampled rows match.
    single = _eval()
    ranks = run_ranks(_eval)
    assert ranks[0] == ranks[1] == single
    assert [r["batch"] for r in single[:-1]] == [0, 0, 1, 1, 2]


def _sweep() -> list[dict]:
    from unmask.eval.sweep import sweep

    res = sweep("stories", "stories260K-sbd", "sbd", param="gamma", values="0,0.5", limit=3, batch_size=2,
                max_new_tokens=8, warmup=False)
    return [{k: p[k] for k in ("value", "quality", "tpf", "nfe")} for p in res.points] + [res.aup_score]


def test_data_parallel_sweep_equals_one_process():
    single = _sweep()
    assert run_ranks(_sweep) == [single, single]


PROMPTS = ["Once upon a time", "The cat sat on the", "Lily and Ben went to the park", "One day, a little bird"]


def _generate_cli(prompts_file: str) -> tuple[int, str]:
    return _cli(["generate", "--model", "stories260K", "--prompts-file", prompts_file, "-n", "12", "--json"])


def test_generate_prompts_file_under_two_processes_prints_every_row_once_in_order(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(PROMPTS) + "\n")
    code, single = _generate_cli(str(f))
    ranks = run_ranks(_generate_cli, str(f))
    assert code == 0 and [c for c, _ in ranks] == [0, 0] and ranks[1][1] == ""

    def strip(text):
        return [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "tps", "batch_seconds", "batch_tps")} for line in text.splitlines()]

    assert strip(ranks[0][1]) == strip(single)
    assert [r["prompt"] for r in strip(single)] == PROMPTS


# ---------------------------------------------------------------------------------------------
# Tensor-parallel decoding
# ---------------------------------------------------------------------------------------------

TP_CASES = (("stories260K", "ar", {}), ("stories260K-sbd", "sbd", {}),
            ("stories260K-sbd", "sbd", {"policy": "entropy-bound", "gamma": 0.5, "block_size": 8}),
            ("stories260K-dlm", "diffusion", {"gen_length": 16}))


def _tp_cases() -> tuple:
    """TP_CASES, plus lossless SBD (``verify``) where the sbd decoder has it (spec/sbd_exact.md)."""
    from unmask.decode import DECODERS

    if "verify" not in {k.name for k in DECODERS["sbd"].knobs()}:
        return TP_CASES
    return TP_CASES + (("stories260K-sbd", "sbd", {"verify": True}), ("stories260K-sbd", "sbd", {"verify": False}))


def _tp_decode(tp) -> dict:
    import unmask
    from unmask.api import generate

    out, sharded = [], []
    for name, decoder, options in _tp_cases():
        bundle = unmask.load(name, tp=tp)
        q = bundle.model.model.layers[0].self_attn.q_proj.weight
        sharded.append(tuple(q.to_local().shape) if hasattr(q, "to_local") else None)
        out.append(generate(PROMPTS[:3], bundle, decoder, max_new_tokens=16, **options).tokens)
    return {"tokens": out, "local_q": sharded}


def test_tp_decode_equals_one_process():
    single = _tp_decode(None)
    ranks = run_ranks(_tp_decode, 2)
    assert ranks[0]["local_q"] == ranks[1]["local_q"] == [(32, 64)] * len(_tp_cases())  # q_proj split over 2
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == single["tokens"]


def test_tp_outside_torchrun_is_a_one_line_error(capsys):
    one_line_error(capsys, "generate", "Once", "--model", "stories260K", "--tp", "2", match="needs exactly 2 processes")


def _train_until_export_fails(run_dir) -> str:
    """Train 2 steps with a checkpoint each step; rank 0's Hugging Face export of step 2 fails."""
    from unmask import dist
    from unmask.train import parallel

    real = parallel.save_model

    def export(model, directory, state_dict=None):
        if "step-00000002" in directory.name:
            raise OSError("disk full")
        real(model, directory, state_dict=state_dict)

    if dist.env_rank() == 0:
        parallel.save_model = export
    try:
        _train(run_dir, replace(CFG, steps=2, ckpt_every=1, fsdp=True))
    except (OSError, UnmaskError) as e:
        return str(e)
    return "no error"


def test_a_failed_checkpoint_stops_every_rank_and_keeps_the_previous_one(tmp_path):
    # Rank 0 fails after every rank wrote its DCP shard: both ranks raise (none waits forever),
    # the staging directory is removed and step 1 stays the newest complete checkpoint.
    errors = run_ranks(_train_until_export_fails, tmp_path)
    assert "disk full" in errors[0] and "another training process failed" in errors[1]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]
    assert latest_checkpoint(tmp_path).name == "step-00000001"


# ---------------------------------------------------------------------------------------------
# Early-Bird routers: responses / traces decoded data-parallel, rank 0 trains
# ---------------------------------------------------------------------------------------------


def _lbs(corpus: str, out: str) -> tuple[int, str]:
    return _cli(["train", "lbs", "--model", "stories260K-dlm", "--data", corpus, "--prompts", "6", "--gen-length", "8",
                 "--block-size", "4", "--epochs", "1", "--gen-batch", "2", "--out", out])


def test_train_lbs_under_two_processes_saves_the_one_process_router(tmp_path):
    corpus = str(ids_file(tmp_path / "c.jsonl"))
    code, text = _lbs(corpus, str(tmp_path / "one"))
    ranks = run_ranks(_lbs, corpus, str(tmp_path / "two"))
    assert code == 0 and [c for c, _ in ranks] == [0, 0] and "params=" in ranks[0][1] and ranks[1][1] == ""
    one, two = load_file(str(tmp_path / "one" / "lbs.safetensors")), load_file(str(tmp_path / "two" / "lbs.safetensors"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_lps_traces_collected_per_batch_concatenate_to_prompt_level_ids():
    from unmask.train.lps_fit import LPSTraces

    def steps(traces, base=0):  # (trace, t, features (n, 5), labels (n,)) per record
        g = torch.Generator().manual_seed(base)
        return [(tr, t, torch.rand(n, 5, generator=g), torch.rand(n, generator=g) > 0.5)
                for tr, t, n in traces]

    first = steps([(0, 0, 3), (0, 1, 2), (1, 0, 4)], 1)  # prompts 0-1 of batch 0
    second = steps([(0, 0, 1), (1, 0, 2), (1, 1, 5)], 2)  # prompts 2-3 of batch 1, ids from 0
    whole = LPSTraces.from_steps(first + [(tr + 2, t, f, y) for tr, t, f, y in second], {"traces": 4})
    merged = LPSTraces.concat([LPSTraces.from_steps(first, {"traces": 2}), LPSTraces.from_steps(second, {"traces": 2})],
                              batch_size=2)
    for name in ("features", "labels", "offsets", "trace", "step"):
        assert torch.equal(getattr(merged, name), getattr(whole, name)), name
    assert merged.meta["traces"] == 4 and merged.n_traces == 4
