"""Training the Early-Bird routers (spec/early_bird.md §3.3–§3.4 LBS, §4.3–§4.4 LPS).

**LBS** (Alg. 3). Responses are the frozen base model's own outputs for the training prompts
(our choice; ``response_policy`` "top-k" = vanilla 1 token/step, or "threshold" = Fast-dLLM τ,
cheaper on CPU), padded to L with the stop id the model ended on. Every epoch each sample draws
a block index n ~ U{0..L/L_B−1} and a ratio r ~ U(0, 1] (:func:`blockwise_mask`, reading #1),
one frozen forward gives H̃, x̂ and the per-position cross-entropy against the response, and
R_φ takes a step on Eq. 3: mean_M(σ·CE) − mean_M(σ) (:func:`lbs_loss`, ``loss="eq3"``), or on the
binary cross-entropy against Eq. 3's own minimiser 1[CE < 1] (:func:`lbs_bce_loss`, ``loss="bce"``,
our choice). Why the option: Eq. 3 is linear in σ and most masked positions of a far-ahead canvas
have CE > 1, so its first steps push σ down everywhere; on stories260K-dlm the router settled
there (train loss 0.29 → 0.007, above 0, while passing the CE < 1 positions would make it
negative; p_φ ≤ 0.003 at every decode selection, benchmarks/results/early_bird_routers.md).
BCE weighs a missed positive by −log σ, which grows as σ falls.

**LPS** (Alg. 4). Traces come from the exact serving configuration: Early-Bird decoding with the
trained LBS and the threshold rule (no LPS), L, L_B, τ, L_min, g_max as served. A step record is
the features of B_t ∩ M_t and the labels y = 1[x̂_t = x_0], x_0 being the trace's final canvas.
By default features are recorded during generation and labelled once x_0 is known; ``replay``
re-runs the model on the recorded schedule and writes x_0's tokens at the recorded commits (the
oracle rule, reading #7). Training: trace-level 80/10/10 split (seed 42), weighted BCE (w⁻ = 2),
AdamW + 0.5 % warm-up + ×0.97 per epoch, batches of 512 step records, after every epoch τ_ψ =
the grid value with the largest validation recall at FPR ≤ 1 % (:func:`select_tau_psi`), early
stopping on that recall (patience 100), and recall / FPR on the test split at the chosen τ_ψ.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

from unmask import dist
from unmask.errors import UnmaskError
from unmask.fileio import check_model_out_dir, output_lock
from unmask.routers.lbs import LBSConfig, LBSRouter
from unmask.routers.lps import LPSConfig, LPSRouter
from unmask.train.progress import Progress, say
from unmask.train.wiring import model_dir
from unmask.train.lbs_fit import (  # noqa: F401  (re-exported: the LBS fit is part of this module's API)
    LBS_LOSSES,
    LBSTrainConfig,
    blockwise_mask,
    lbs_bce_loss,
    lbs_inputs,
    lbs_loss,
    train_lbs,
)
from unmask.train.lps_fit import (  # noqa: F401  (re-exported: the LPS half of this module's API)
    LPSTrainConfig,
    predict,
    rates,
    select_tau_psi,
    split_traces,
    train_lps,
    weighted_bce,
)
from unmask.train.lps_traces import LPSTraces, collect_lps_traces, label_records, replay_traces  # noqa: F401



# ---------------------------------------------------------------------------------------------
# Prompts and responses
# ---------------------------------------------------------------------------------------------


def prompts_from_corpus(paths: Sequence, n: int, *, bos: int, seed: int = 0, from_end: bool = False,
                        prefix_range: tuple[int, int] = (4, 24), vocab_size: int | None = None,
                        tokenizer=None) -> list[list[int]]:
    """``n`` prompts [BOS] + the first k ~ U[prefix_range] ids of corpus documents (JSONL/TXT via
    :func:`unmask.train.data.read_documents`; ``tokenizer`` encodes text documents), in a seeded
    document order. LBS takes its prompts from the front of that order and LPS (``from_end``) from
    the back, so the two sets are disjoint while together they fit the corpus. Raises UnmaskError
    when the corpus holds fewer documents."""
    from unmask.train.data import read_documents

    docs = [r["ids"] for p in paths for r in read_documents(p, tokenizer, vocab_size=vocab_size) if len(r["ids"]) >= 2]
    random.Random(seed).shuffle(docs)
    if n > len(docs):
        raise UnmaskError(f"the corpus holds {len(docs)} usable documents, {n} needed; add data with --data or ask "
                          "for fewer --prompts")
    picked = docs[::-1][:n] if from_end else docs[:n]
    rng = random.Random(seed + (1 if from_end else 0))
    lo, hi = prefix_range
    return [[bos] + d[: rng.randint(min(lo, len(d) - 1), min(hi, len(d) - 1))] for d in picked]


def pad_response(canvas: Sequence[int | None], stop_ids: Sequence[int], L: int, fill: int) -> list[int]:
    """The response as the model ended it, L ids: everything before the first stop id (or mask,
    None), then that stop id (``fill`` when the cut was a mask or the canvas ended) repeated."""
    out: list[int] = []
    for t in list(canvas)[:L]:
        if t is None or t in stop_ids:
            fill = fill if t is None else t
            break
        out.append(int(t))
    return out + [fill] * (L - len(out))


def generate_responses(bundle, prompts: list[list[int]], *, gen_length: int, block_size: int = 32,
                       policy: str = "top-k", tau: float = 0.9, cache: str = "none", batch_size: int = 16,
                       max_minutes: float | None = None, progress: Progress = None) -> list[list[int]]:
    """The base model's own greedy responses (L ids each, EOS-padded, §3.4): ``policy="top-k"``
    is vanilla 1 token/step decoding, ``"threshold"`` Fast-dLLM at τ (both with L_B blocks;
    ``cache`` as in the diffusion decoder). With ``max_minutes`` generation stops before a batch
    that would not fit (judged by the previous one), so fewer responses than prompts may come back
    (the first ones)."""
    from unmask.decode import DECODERS

    stops = tuple(bundle.stop_token_ids)
    if not stops:
        raise UnmaskError(f"{bundle.name} has no stop token, so responses cannot be EOS-padded; name its "
                          "stop_token_ids in the model's unmask_config.json")
    options = {"top-k": {"policy": "top-k", "tokens_per_step": 1}, "threshold": {"policy": "threshold", "tau": tau}}
    if policy not in options:
        raise UnmaskError(f"unknown response policy --responses {policy!r}; choose top-k (vanilla) or threshold")
    out: list[list[int]] = []
    t0 = time.monotonic()
    last = 0.0  # seconds of the previous batch: stop when the next one would not fit the budget
    for s in range(0, len(prompts), batch_size):
        if max_minutes is not None and time.monotonic() - t0 + last > 60 * max_minutes:
            break
        tb = time.monotonic()
        batch = prompts[s: s + batch_size]
        canvases: dict[int, list] = {}
        DECODERS["diffusion"].decode(bundle, batch, max_new_tokens=gen_length, gen_length=gen_length, block_size=block_size,
                         stop_token_ids=stops, on_step=lambda e: canvases.__setitem__(e["row"], e["canvas"]),
                         cache=cache, **options[policy])
        out += [pad_response(canvases[r], stops, gen_length, stops[0]) for r in range(len(batch))]
        last = time.monotonic() - tb
        say(progress, f"responses {len(out)}/{len(prompts)} ({time.monotonic() - t0:.0f} s)")
    return out


# ---------------------------------------------------------------------------------------------
# Saving with provenance (used by the CLI and the recipe)
# ---------------------------------------------------------------------------------------------


def save_lbs(router: LBSRouter, bundle, directory, report: dict | None = None) -> Path:
    """Save R_φ with the base model's facts (vocabulary check on load) and its training report."""
    from unmask.routers.io import base_model_facts, save_router

    return save_router(router, directory, meta={"base_model": base_model_facts(bundle), "training": report or {}})


def save_lps(router: LPSRouter, tau_psi: float, bundle, directory, report: dict | None = None,
             serving: dict | None = None) -> Path:
    """Save R_ψ with τ_ψ, its validation/test metrics and the serving configuration its traces
    were collected under (the decoder's defaults for L_B, τ, L_min, g_max)."""
    from unmask.routers.io import base_model_facts, save_router

    report = dict(report or {})
    history = report.pop("history", None)
    meta = {"tau_psi": float(tau_psi), "base_model": base_model_facts(bundle), "serving": serving or {},
            "metrics": {k: report.get(k) for k in ("val", "test", "split", "best_epoch")},
            "training": {**report, "history_tail": (history or [])[-5:]}}
    return save_router(router, directory, meta=meta)


# ---------------------------------------------------------------------------------------------
# End to end: what ``unmask train lbs`` / ``unmask train lps`` run
# ---------------------------------------------------------------------------------------------


def _load(model, device):
    from unmask.models import ModelBundle, load

    bundle = model if isinstance(model, ModelBundle) else load(model, device=device)
    if bundle.kind != "masked-diffusion" or bundle.mask_token_id is None:
        raise UnmaskError(f"Early-Bird routers need a masked-diffusion model with a mask token, {bundle.name!r} is "
                          f"{bundle.kind!r}; pass a masked-diffusion model with --model")
    return bundle


# Saving a router swaps in a copy of its directory with the new pair added (routers.io.save_router).
ROUTER_OUT = {"markers": ("lbs.json", "lps.json", "lbs.safetensors", "lps.safetensors"),
              "kind": "a router directory (no lbs.json or lps.json)",
              "replaced": "which saving the router would replace with a copy"}


def _check_router_out(where, data: Sequence = (), model_dir=None) -> Path:
    """``where`` as a Path when a router may be saved there (:func:`unmask.fileio.check_model_out_dir`):
    named, not a file, neither the ``data`` files nor the model directory nor a folder holding them,
    and when it exists and is not empty, a router directory. Raises UnmaskError naming --out."""
    reads = [(p, f"the --data file {p}") for p in data if isinstance(p, (str, Path))]
    if model_dir is not None:
        reads.append((model_dir, f"the --model directory {model_dir}"))
    return check_model_out_dir(where, reads, True, what="--out", example="routers", **ROUTER_OUT)


def _out_dir(bundle, out, *, writes: str | None = None, overwrite: bool = False, data: Sequence = ()) -> Path:
    """The router directory: ``out``, else MODEL_DIR/routers. With ``writes`` ("lbs" / "lps"),
    check it can take a router (:func:`_check_router_out`) and refuse to replace that router there
    (by default: inside the model, which for a shipped model is the installed package) unless
    ``overwrite``."""
    from unmask.routers.io import routers_dir

    where = routers_dir(bundle, out)
    if where is None:
        raise UnmaskError(f"{bundle.name!r} has no model directory; pass --out DIR for the routers")
    if writes is not None:
        _check_router_out(where, data, bundle.path)
    if writes is not None and not overwrite and (Path(where) / f"{writes}.json").exists():
        raise UnmaskError(f"{where} already holds an {writes.upper()} router; pass --out DIR for a new one "
                          "or --overwrite to replace it")
    return where


def _check_counts(**flags) -> None:
    """Integer command options that must be >= 1, named by their --flag."""
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnmaskError(f"{flag} must be an integer >= 1, got {value!r}; pass {flag} 1 or more")


def _check_router_sizes(router: dict | None, config_cls, even: bool) -> None:
    """--d / --layers / --ffn of a router before any generation (the config re-checks the rest)."""
    router = router or {}
    _check_counts(**{k: router[k] for k in ("d", "layers", "ffn") if k in router})
    d, heads = router.get("d", config_cls.d), router.get("heads", config_cls.heads)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        return  # not a command option; the config names it
    step = math.lcm(2, heads) if even else heads
    if d % step:
        what = f"even and divisible by the {heads} heads" if even else f"divisible by the {heads} heads"
        raise UnmaskError(f"router width --d {d} must be {what}; pass a multiple of {step}, "
                          f"e.g. --d {max(step, d // step * step)}")


def _check_context(bundle, prompts: list[list[int]], gen_length: int) -> None:
    P = max(len(p) for p in prompts)
    if P + gen_length > bundle.context_length:
        raise UnmaskError(f"prompt ({P} tokens) + --gen-length {gen_length} exceeds the context window of "
                          f"{bundle.context_length}; pass --gen-length {bundle.context_length - P} or less")


def _per_batch(fn, items: list, batch_size: int) -> list:
    """``[fn(items)]`` in one process; under torchrun ``fn`` of each ``batch_size`` batch, dealt to
    the ranks and gathered in order (:func:`unmask.dist.map_batches`), the same batches either way."""
    from unmask import dist

    return dist.map_batches(fn, items, batch_size) if dist.active() else [fn(items)]


def _rank0_lock(where):
    """The output lock of a router directory; under torchrun rank 0 holds it for the whole job."""
    return output_lock(where, "router directory") if dist.is_main() else contextlib.nullcontext()


def run_lbs(*, model, data: Sequence, out=None, n_prompts: int = 1000, gen_length: int = 256, block_size: int = 32,
            response_policy: str = "top-k", response_cache: str = "none", gen_batch: int = 16,
            train: LBSTrainConfig | None = None, router: dict | None = None, overwrite: bool = False,
            device: str = "cpu", progress: Progress = None) -> dict:
    """Prompts from ``data`` (ids, or text encoded with the model's tokenizer), the model's own
    responses, Alg. 3 training, save to ``out`` (default MODEL_DIR/routers). ``router``: LBSConfig
    fields (d, layers, heads, ffn). Every option, and an existing LBS router at the output (kept
    unless ``overwrite``), is checked before any response is generated; the output directory is
    locked against a second writer for the whole run. Returns a summary (an empty dict on the
    ranks other than 0 under torchrun, which only decode responses)."""
    from unmask.decode.dllm.cache import CACHE_MODES

    _check_counts(prompts=n_prompts, gen_length=gen_length, block_size=block_size, gen_batch=gen_batch)
    if gen_length % block_size:
        if block_size > gen_length:  # a longer canvas is not what was asked for
            raise UnmaskError(f"--block-size {block_size} is longer than --gen-length {gen_length}; pass a "
                              f"--block-size that divides {gen_length}")
        raise UnmaskError(f"--gen-length {gen_length} is not a multiple of --block-size {block_size}; pass e.g. "
                          f"--gen-length {gen_length // block_size * block_size}")
    if response_policy not in ("top-k", "threshold"):
        raise UnmaskError(f"unknown response policy --responses {response_policy!r}; choose top-k (vanilla) or "
                          "threshold")
    if response_cache not in CACHE_MODES:
        raise UnmaskError(f"unknown --response-cache {response_cache!r}; choose one of: {', '.join(CACHE_MODES)}")
    _check_router_sizes(router, LBSConfig, even=True)
    from unmask import dist

    if out is not None:
        _check_router_out(Path(out).expanduser(), data, model_dir(model))  # before the model loads
    bundle = _load(model, dist.setup(device))
    where = _out_dir(bundle, out, writes="lbs", overwrite=overwrite, data=data)
    with _rank0_lock(where):
        _out_dir(bundle, out, writes="lbs", overwrite=overwrite, data=data)  # again, locked
        return _run_lbs(bundle, where, data, n_prompts, gen_length, block_size, response_policy, response_cache,
                        gen_batch, train, router, progress)


def _run_lbs(bundle, where, data, n_prompts, gen_length, block_size, response_policy, response_cache, gen_batch,
             train, router, progress) -> dict:
    train = train or LBSTrainConfig(block=block_size)
    emb = bundle.model.get_input_embeddings().weight
    rc = LBSConfig(gen_length=gen_length, d_base=int(emb.shape[1]), vocab_size=int(emb.shape[0]), **(router or {}))
    vocab = emb.shape[0]
    prompts = prompts_from_corpus(data, n_prompts, bos=bundle.bos_token_id if bundle.bos_token_id is not None else 1,
                                  seed=train.seed, vocab_size=vocab, tokenizer=bundle.tokenizer)
    _check_context(bundle, prompts, gen_length)
    # Under torchrun the responses are decoded data-parallel; rank 0 then trains and saves alone.
    progress = progress if dist.is_main() else None
    responses = [r for part in _per_batch(
        lambda batch: generate_responses(bundle, batch, gen_length=gen_length, block_size=block_size,
                                         policy=response_policy, cache=response_cache, batch_size=gen_batch,
                                         progress=progress), prompts, gen_batch) for r in part]
    if not dist.is_main():
        return {}
    lbs, report = train_lbs(bundle, prompts, responses, train, rc, progress=progress)
    report.update(prompts=len(prompts), response_policy=response_policy, response_cache=response_cache,
                  gen_length=gen_length)
    path = save_lbs(lbs, bundle, where, report)
    return {"out": str(path), "params": lbs.n_params(), "epochs": report["epochs"],
            "train_loss": report["train_loss"][-1] if report["train_loss"] else None,
            "val_loss": report["val_loss"][-1] if report["val_loss"] else None}


def run_lps(*, model, data: Sequence, routers=None, out=None, n_prompts: int = 300, block_size: int = 32,
            tau: float = 0.9, l_min: int = 8, g_max: int = 5, pos_mode: str = "literal", replay: bool = False,
            gen_batch: int = 16, traces_file=None, train: LPSTrainConfig | None = None, router: dict | None = None,
            seed: int = 0, overwrite: bool = False, device: str = "cpu", progress: Progress = None) -> dict:
    """Collect traces with the saved LBS (``routers``, default MODEL_DIR/routers) under the serving
    configuration, train R_ψ, choose τ_ψ, save next to the LBS (or to ``out``). ``traces_file``
    caches the traces (reused when it exists). An existing LPS router at the output is kept unless
    ``overwrite``. The output directory is locked against a second writer for the whole run.
    Returns a summary with test recall / FPR (an empty dict on the ranks other than 0 under
    torchrun, which only collect traces)."""
    from unmask.decode.dllm.eb_select import POS_MODES

    if pos_mode not in POS_MODES:
        raise UnmaskError(f"unknown --pos-mode {pos_mode!r}; choose one of: {', '.join(POS_MODES)}")
    _check_router_sizes(router, LPSConfig, even=False)
    rc = LPSConfig(pos_mode=pos_mode, **(router or {}))  # checked before any trace is collected
    from unmask import dist

    if out is not None:
        _check_router_out(Path(out).expanduser(), data, model_dir(model))  # before the model loads
    bundle = _load(model, dist.setup(device))
    progress = progress if dist.is_main() else None
    source = _out_dir(bundle, routers)
    target = out if out is not None else source
    where = _out_dir(bundle, target, writes="lps", overwrite=overwrite, data=data)
    with _rank0_lock(where):
        _out_dir(bundle, target, writes="lps", overwrite=overwrite, data=data)  # again, locked
        return _run_lps(bundle, source, where, data, n_prompts, block_size, tau, l_min, g_max, pos_mode, replay,
                        gen_batch, traces_file, train, rc, seed, progress)


def _run_lps(bundle, source, where, data, n_prompts, block_size, tau, l_min, g_max, pos_mode, replay, gen_batch,
             traces_file, train, rc, seed, progress) -> dict:
    from unmask.routers.io import check_lbs_fits, load_router

    lbs, info = load_router(source, "lbs", device=bundle.device)
    check_lbs_fits(info, bundle)
    serving = {"block_size": block_size, "tau": tau, "l_min": l_min, "g_max": g_max}
    if traces_file is not None and Path(traces_file).is_file():
        traces = LPSTraces.load(traces_file)
        say(progress, f"LPS traces: reusing {traces_file} ({traces.n_traces} traces, {traces.n_records} records)")
    else:
        _check_counts(prompts=n_prompts, gen_batch=gen_batch)
        if n_prompts < 3:  # one trace per prompt; refused before collecting them
            raise UnmaskError(f"LPS training needs at least 3 traces for its 80/10/10 split (got --prompts "
                              f"{n_prompts}); pass --prompts 3 or more")
        vocab = bundle.model.get_input_embeddings().weight.shape[0]
        prompts = prompts_from_corpus(data, n_prompts, bos=bundle.bos_token_id if bundle.bos_token_id is not None
                                      else 1, seed=seed, from_end=True, vocab_size=vocab, tokenizer=bundle.tokenizer)
        # Under torchrun the traces are collected data-parallel; rank 0 then trains and saves alone.
        traces = LPSTraces.concat(_per_batch(
            lambda batch: collect_lps_traces(bundle, lbs, batch, pos_mode=pos_mode, replay=replay,
                                             batch_size=gen_batch, progress=progress, **serving), prompts, gen_batch),
            gen_batch)
        if traces_file is not None and dist.is_main():
            traces.save(traces_file)
    if not dist.is_main():
        return {}
    lps, tau_psi, report = train_lps(traces, train or LPSTrainConfig(), rc, device=bundle.device, progress=progress)
    report["traces"] = traces.meta
    path = save_lps(lps, tau_psi, bundle, where, report, serving)
    return {"out": str(path), "tau_psi": tau_psi, "params": lps.n_params(), "traces": traces.n_traces,
            "records": traces.n_records, "val": report["val"], "test": report["test"], "epochs": report["epochs"],
            "stopped": report["stopped"]}
