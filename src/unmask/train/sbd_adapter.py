"""Train a gated SBD adapter on a frozen causal LM (spec/sbd_exact.md §3).

The base is loaded unchanged, wrapped with a gated adapter (unmask.models.sbd_adapter) and
trained with the **masked-token term of SBD Eq. 14 only** (spec/sbd.md §3.4): the NTP term is
constant, since non-mask tokens run the frozen base exactly. The layout and attention mask are
SBD's (sbd.md §3.2–3.3: clean half causal, noisy blocks after the clean prefix of earlier
blocks), with the noise level chosen per row:

- **draft rows** (share ``draft_fraction``): η = 1, every block is all-mask, i.e. K mask tokens
  right after a clean prefix, attending causally to the prefix and bidirectionally within the
  block: exactly the draft groups of the lossless decoder (sbd_exact.md §1);
- the other rows: η ~ U(0,1) (partial masking), which keeps the EB decoder usable (sbd.md §5).

Validation scores draft mode only, at a fixed block size (``eval_block_size``), and reports the
masked CE per block offset (0, 1, 2, 3, 7) next to the base's NTP CE on the same rows: the
numbers of :func:`unmask.train.objectives.offset_ce` (same pure reduction, tested equal).

With a corpus whose records carry ``loss_start`` (answer-only training, issue 18), prompt tokens
are never targets; logits are formed only at target positions (unmask.train.lm_loss).

The loop is the shared one (unmask.train.loop); checkpoints hold only the adapter
(``adapter.safetensors`` + ``adapter.json``), and the result is published atomically as an
adapter directory that ``unmask.load(base, adapter=DIR)`` opens.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from unmask import dist
from unmask.decode.verify import config as sbd_verify
from unmask.errors import UnmaskError
from unmask.train.lm_loss import lm_nll
from unmask.train.loop import TrainResult, train
from unmask.train.objectives import IGNORE, OFFSETS, offset_terms, sample_block_size, sbd_batch
from unmask.train.wiring import holds_output_locks, load_labelled_chunks, run_info, run_paths, train_config


@dataclass(frozen=True)
class AdapterObjective:
    """Masked-token term of Eq. 14 with draft-mode rows, for :func:`unmask.train.loop.train`.

    Training (``model.training``): k ~ U{block_range} per step; per row η = 1 with probability
    ``draft_fraction``, else η ~ U(0,1). Evaluation (``model.eval()``): k = ``eval_block_size``
    and η = 1 on every row. Terms: ``mat`` (the loss: masked CE over all rows), ``draft``
    (masked CE of the draft rows), ``ntp`` (the base's NTP CE, evaluation only, else 0) and
    ``d0 d1 d2 d3 d7`` (draft-row masked CE at block offset j; 0 where no target).
    """

    mask_token_id: int
    block_range: tuple[int, int] = (2, 16)
    draft_fraction: float = 0.5
    eval_block_size: int = 8
    distill_lambda: float | None = None
    name: str = "sbd-adapter"
    term_names: tuple[str, ...] = ("mat", "draft", "ntp") + tuple(f"d{j}" for j in OFFSETS)

    def __post_init__(self):
        if self.distill_lambda is not None:  # self-distilled block mode (spec/sbd_exact.md §5.5)
            from unmask.train.sbd_distill import check_lambda

            object.__setattr__(self, "distill_lambda", check_lambda(self.distill_lambda))
            object.__setattr__(self, "name", "sbd-adapter-distill")
            object.__setattr__(self, "term_names", self.term_names + ("kl",))
        low, high = self.block_range
        if not 1 <= low <= high:
            raise UnmaskError(f"block range must satisfy 1 <= low <= high, got {self.block_range}; pass e.g. 2 16")
        if not 0 <= self.draft_fraction <= 1:
            raise UnmaskError(f"--draft-fraction must be in [0, 1], got {self.draft_fraction}; pass e.g. 0.5")
        if self.eval_block_size < 1:
            raise UnmaskError(f"--block-size must be >= 1, got {self.eval_block_size}; pass e.g. 8")

    def step_params(self, generator: torch.Generator) -> dict:
        return {"k": sample_block_size(generator, *self.block_range)}

    def loss(self, model, chunks: torch.Tensor, generator: torch.Generator, *, k: int,
             labels: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """chunks (B, L+1) long, labels (B, L+1) bool or None -> (masked CE with grad, terms)."""
        B = chunks.shape[0]
        if model.training:
            draft = torch.rand(B, generator=generator) < self.draft_fraction  # (B,) CPU
            eta = torch.where(draft, torch.ones(B), torch.rand(B, generator=generator))  # (B,)
        else:
            k, draft, eta = self.eval_block_size, torch.ones(B, dtype=torch.bool), torch.ones(B)
        batch = sbd_batch(chunks, self.mask_token_id, k, generator, eta=eta, labels=labels)
        return adapter_loss(model, batch, k, self.mask_token_id, draft.to(chunks.device), ntp=not model.training,
                            distill_lambda=self.distill_lambda)


def adapter_loss(model, batch: dict, k: int, mask_id: int, draft: torch.Tensor, *, ntp: bool,
                 distill_lambda: float | None = None) -> tuple[torch.Tensor, dict]:
    """Masked-token CE of Eq. 14 (term 2 only) over the SBD layout, in two forwards.

    The clean half runs first without gradients (it is the frozen base: no gate is set on it)
    and leaves its K/V in a cache; the noisy half then runs on that cache with the noisy rows
    of the §3.3 mask (L, 2L). This equals one forward over the 2L tokens (tested) but skips the
    backward through the clean half. batch: :func:`sbd_batch` output; draft: (B,) bool rows
    built with η = 1. The mask logit is −inf. With ``ntp`` the clean half's logits give the
    base's NTP CE term. Logits are formed at target positions only (unmask.train.lm_loss).
    With ``distill_lambda`` λ the loss is ``(Σ CE + λ Σ KL(p_base ‖ p_block)) / targets`` over the
    masked targets (spec/sbd_exact.md §5.5), the teacher being the clean half's base logits
    (:func:`_distill_loss`), and ``terms["kl"]`` its mean.
    Returns (loss, terms) as :class:`AdapterObjective` describes.
    """
    if distill_lambda is not None:
        return _distill_loss(model, batch, k, mask_id, draft, ntp=ntp, lam=distill_lambda)
    from unmask.compat import attention_mask, forward, new_cache
    from unmask.masks import as_4d, sbd_training_mask

    L = batch["L"]
    ids, pos = batch["input_ids"], batch["position_ids"]  # (B, 2L) each
    B, device = ids.shape[0], ids.device
    rule = sbd_training_mask(L, k, device=device)  # (2L, 2L) bool
    clean_mask = attention_mask(model, as_4d(rule[:L, :L], B))  # (B, 1, L, L)
    cache = new_cache(model)
    with torch.no_grad():
        if ntp:
            ntp_nll = lm_nll(model, ids[:, :L], position_ids=pos[:, :L], attention_mask=clean_mask, cache=cache,
                             labels=batch["labels"][:, :L], suppress=mask_id)  # (B, L)
        else:  # the clean half only fills the cache
            forward(model, ids[:, :L], position_ids=pos[:, :L], cache=cache, logits_to_keep=1,
                    attention_mask=clean_mask)
    labels = batch["labels"][:, L:]  # (B, L) unshifted targets
    nll = lm_nll(model, ids[:, L:], position_ids=pos[:, L:], cache=cache, labels=labels, suppress=mask_id,
                 attention_mask=attention_mask(model, as_4d(rule[L:, :], B)))  # (B, L)
    valid = labels != IGNORE  # (B, L)
    loss = nll.sum() / valid.sum().clamp(min=1)
    with torch.no_grad():
        dvalid = valid & draft[:, None]  # (B, L)
        terms = {"mat": loss.detach(), "draft": nll[dvalid].sum() / dvalid.sum().clamp(min=1),
                 **offset_terms(nll, dvalid, k, OFFSETS), "ntp": torch.zeros(())}
        if ntp:
            seen = batch["labels"][:, :L] != IGNORE  # (B, L)
            terms["ntp"] = ntp_nll.sum() / seen.sum().clamp(min=1)
    return loss, terms


def _distill_loss(model, batch: dict, k: int, mask_id: int, draft: torch.Tensor, *, ntp: bool,
                  lam: float) -> tuple[torch.Tensor, dict]:
    """:func:`adapter_loss` with the KL term: the clean half (the frozen base, no gate set) runs
    under ``no_grad`` and keeps its final hidden states, the teacher's; the noisy half runs on its
    cache with grad. Same two-forward scheme and terms as :func:`adapter_loss`, plus ``kl``."""
    from unmask.compat import attention_mask, final_hidden, new_cache
    from unmask.masks import as_4d, sbd_training_mask
    from unmask.train.lm_loss import chunked_cross_entropy
    from unmask.train.sbd_distill import chunked_kl, need_head, teacher_pairs

    L = batch["L"]
    ids, pos = batch["input_ids"], batch["position_ids"]  # (B, 2L) each
    B, device = ids.shape[0], ids.device
    weight, bias = need_head(model)
    rule = sbd_training_mask(L, k, device=device)  # (2L, 2L) bool
    cache = new_cache(model)
    with torch.no_grad():
        clean = final_hidden(model, ids[:, :L], position_ids=pos[:, :L], cache=cache,
                             attention_mask=attention_mask(model, as_4d(rule[:L, :L], B)))  # (B, L, d)
    labels = batch["labels"][:, L:]  # (B, L) unshifted targets
    valid = labels != IGNORE  # (B, L)
    noisy = final_hidden(model, ids[:, L:], position_ids=pos[:, L:], cache=cache,
                         attention_mask=attention_mask(model, as_4d(rule[L:, :], B)))  # (B, L, d)
    ce = chunked_cross_entropy(noisy[valid], weight, labels[valid], bias=bias, suppress=mask_id)  # (n,)
    nll = torch.zeros(labels.shape, dtype=torch.float32, device=device).masked_scatter(valid, ce)  # (B, L)
    student, teacher = teacher_pairs(valid)  # (B, L) each
    kl = chunked_kl(noisy[student], clean[teacher], weight, bias=bias, suppress=mask_id)  # (m,)
    loss = (ce.sum() + lam * kl.sum()) / valid.sum().clamp(min=1)
    with torch.no_grad():
        dvalid = valid & draft[:, None]  # (B, L)
        terms = {"mat": nll.sum() / valid.sum().clamp(min=1), "draft": nll[dvalid].sum() / dvalid.sum().clamp(min=1),
                 **offset_terms(nll, dvalid, k, OFFSETS), "ntp": torch.zeros(()),
                 "kl": kl.sum() / max(1, kl.numel())}
        if ntp:
            seen = batch["labels"][:, :L] != IGNORE  # (B, L)
            base_nll = chunked_cross_entropy(clean[seen], weight, batch["labels"][:, :L][seen], bias=bias,
                                             suppress=mask_id)  # (n_seen,)
            terms["ntp"] = base_nll.sum() / seen.sum().clamp(min=1)
    return loss, terms


def _load_base(base: str, dtype: str):
    from unmask.models import load

    bundle = load(base, dtype=dtype)
    cls = type(bundle.model).__name__
    if not cls.endswith("ForCausalLM") or getattr(bundle.model.config, "is_encoder_decoder", False):
        raise UnmaskError(f"base {base!r} is a {cls}, not a decoder-only causal LM; SBD adapters apply to causal "
                          "LMs, pass one with --base (Llama, Qwen2, Qwen3, ...)")
    if bundle.kind not in ("causal", "sbd"):
        raise UnmaskError(f"base {base!r} is a {bundle.kind} model; SBD adapters apply to causal LMs, pass one "
                          "with --base")
    return bundle


@holds_output_locks
def train_sbd_adapter(*, base: str, data: str | Path | Sequence[str | Path], out: str | Path,
                      run_dir: str | Path | None = None, rank: int | None = 16, full_rank: bool = False,
                      targets: Sequence[str] | None = None, seq_len: int = 256, block_range: tuple[int, int] = (2, 16),
                      draft_fraction: float = 0.5, block_size: int = 8, decode_defaults: dict | None = None,
                      val_fraction: float = 0.05, answer_only: bool | None = None, resume: bool = False,
                      overwrite: bool = False, device: str = "cpu", dtype: str = "float32", progress: bool = True,
                      init: str | Path | None = None, distill: bool = False, distill_lambda: float | None = None,
                      **config) -> TrainResult:
    """Train a gated SBD adapter for the frozen ``base`` on ``data`` and publish it at ``out``.

    Args:
        base: shipped name or local HF directory of a Llama/Qwen2/Qwen3 causal LM.
        data: ``.txt`` / ``.jsonl`` corpora (self-distilled greedy text raises acceptance).
        out: adapter directory (``adapter.safetensors`` + ``adapter.json``), written atomically
            when training ends; not written when the run is interrupted.
        rank: r of ``ΔW = B A``; ``full_rank=True`` trains a full ``ΔW`` instead (tiny models).
        targets: names of the adapted ``nn.Linear`` layers (default q/k/v/o + MLP projections);
            an empty list or a name the base has no linear layer of is refused, naming its layers.
        seq_len: L per row (a forward sees 2L). block_range: training k ~ U{low..high}.
        draft_fraction: share of rows with all-mask blocks (η = 1); the rest η ~ U(0,1).
        block_size: the validation block size, and the lossless decode block size recorded in
            ``decode_defaults["verify_block_size"]``.
        decode_defaults: recorded in adapter.json (default lossless SBD at ``block_size``:
            ``{"verify": True, "verify_block_size": block_size, "draft": "linear"}``, the draft
            layout measured fastest).
        answer_only: train only on tokens from each record's ``loss_start`` on (None: when the
            corpus has ``loss_start``; True requires it; False trains every token).
        dtype: ``float32`` or ``bfloat16``, the dtype the base (and the adapter) are loaded in.
        init: an adapter of ``base`` to start from (a name it ships, e.g. ``"sbd"``, or a
            directory): its rank, targets and mask token replace ``rank``/``full_rank``/``targets``,
            its weights are the starting point, and its decode defaults and training record carry
            over (a fine-tune, e.g. a ``distill`` stage after the base recipe).
        distill: self-distilled block mode (spec/sbd_exact.md §5.5): ``data`` must be a greedy
            ``unmask data distill`` corpus of ``base`` (no adapter), and the loss adds
            ``distill_lambda · KL(p_base ‖ p_block)`` at every masked target, the untouched
            base's NTP logits of the clean half being the teacher.
        distill_lambda: λ (default :data:`unmask.train.sbd_distill.DEFAULT_LAMBDA`); only with ``distill``.
        **config: :class:`~unmask.train.loop.TrainConfig` fields (lr, steps, max_minutes, ...).

    Returns:
        TrainResult with ``out`` set (None when interrupted).

    Raises:
        UnmaskError: bad data/paths/options (a rank above the hidden size, unknown ``targets``,
            out-of-range loop options), a base that is not a causal LM, an output that exists
            without overwrite/resume, a run that diverged or whose loss exploded (nothing is
            published), an output that cannot be written (full disk), an ``init`` adapter of
            another base, or a ``distill`` combination or corpus :mod:`unmask.train.sbd_distill` refuses.
    """
    from unmask.fileio import atomic_write_json, publish_dir, staging_dir, sweep_stale_staging, write_errors
    from unmask.models.adapter_io import (ADAPTER_JSON, adapter_config, load_adapter_weights, read_adapter_config,
                                          resolve_adapter, save_adapter_weights, weights_hash)
    from unmask.models.sbd_adapter import DEFAULT_TARGETS, AdapterSpec, attach, check_targets, linear_names

    from unmask.train.sbd_distill import check_distill_corpus, check_distill_options

    cfg = train_config(config)
    lam = check_distill_options(distill, distill_lambda, answer_only, cfg.fsdp)
    paths, out, run_dir = run_paths(data, out, run_dir, resume=resume, overwrite=overwrite, base=base,
                                     init=init, adapter=True)
    if distill:
        check_distill_corpus(paths, base)
    bundle = _load_base(base, dtype)
    context = bundle.context_length
    if not 1 <= seq_len <= context:
        raise UnmaskError(f"--seq-len {seq_len} must be between 1 and the model's context of {context} tokens; "
                          "pass a --seq-len in that range")
    low, high = block_range
    if not 1 <= low <= high <= seq_len:
        raise UnmaskError(f"block range [{low}, {high}] must satisfy 1 <= low <= high <= --seq-len ({seq_len}); "
                          "pass a block range inside it or raise --seq-len")
    if not 1 <= block_size <= seq_len:
        raise UnmaskError(f"--block-size {block_size} must be between 1 and --seq-len ({seq_len}); pass e.g. 8")
    vocab = bundle.model.get_input_embeddings().weight.shape[0]
    base_sha = weights_hash(bundle.path)
    init_cfg = init_dir = None
    if init is not None:
        init_name, init_dir = resolve_adapter(bundle.path, init)
        init_cfg = read_adapter_config(init_dir)
        if init_cfg["base"]["sha256"] != base_sha:
            raise UnmaskError(f"--init adapter {init_name!r} was trained on {init_cfg['base']['name']!r}, not on "
                              f"{base!r}; pass an adapter of {base!r} or --base {init_cfg['base']['name']}")
        rank, full_rank, targets = init_cfg.get("rank"), init_cfg.get("rank") is None, init_cfg["target_modules"]
        mask_id = int(init_cfg["mask_token_id"])
    else:
        mask_id = bundle.mask_token_id if bundle.mask_token_id is not None else vocab
    if targets is None:  # the default projections this model has (all seven on Llama/Qwen)
        targets = [t for t in DEFAULT_TARGETS if t in linear_names(bundle.model)] or list(DEFAULT_TARGETS)
    check_targets(bundle.model, list(targets) if isinstance(targets, (list, tuple)) else targets)
    spec = AdapterSpec(rank=None if full_rank else rank, mask_token_id=int(mask_id), base_vocab=vocab,
                       targets=tuple(targets))
    adapter = attach(bundle.model, spec, seed=cfg.seed)
    if init_dir is not None:
        load_adapter_weights(adapter, init_dir)
    rows = load_labelled_chunks(paths, bundle.tokenizer, vocab, seq_len, val_fraction=val_fraction, seed=cfg.seed,
                                answer_only=answer_only)  # (N, L+1), (M, L+1) and their label masks
    train_chunks, val_chunks = rows.train, rows.val
    objective = AdapterObjective(mask_token_id=spec.mask_token_id, block_range=(low, high),
                                 draft_fraction=draft_fraction, eval_block_size=block_size, distill_lambda=lam)
    what = "sbd-adapter: masked term of Eq. 14" + ("" if lam is None else f" + {lam:g} KL(base NTP || block) on the "
                                                  "base's greedy text (sbd_exact.md §5.5)")
    info = run_info(seq_len, paths, train_chunks, val_chunks, cfg, objective=f"{what}, draft rows "
                    f"{draft_fraction:g}, k ~ U{{{low}..{high}}}", answer_only=rows.answer_only, dtype=dtype)
    if init_cfg is not None:
        info["init"] = {"adapter": str(init), "training": init_cfg.get("training")}
    if decode_defaults is not None:
        defaults = dict(decode_defaults)
    elif init_cfg is not None and init_cfg.get("decode_defaults"):
        defaults = dict(init_cfg["decode_defaults"])
    else:
        defaults = {"verify": True, "verify_block_size": block_size, "draft": sbd_verify.DEFAULT_DRAFT}

    def json_for(state: dict) -> dict:
        training = {**info, "step": state.get("step"), "stopped": state.get("stopped"),
                    "train_terms": state.get("last"), "val": state.get("val")}
        return adapter_config(adapter, base_name=base, base_sha256=base_sha, decode_defaults=defaults,
                              training=training)

    def save_extras(directory: Path, state: dict) -> None:
        from unmask.fileio import atomic_write_json

        atomic_write_json(directory / ADAPTER_JSON, json_for(state), "adapter config")

    console = None
    if progress:
        from rich.console import Console

        console = Console(stderr=True)
    result = train(bundle.model, objective, train_chunks, val_chunks, cfg, run_dir, device=device, resume=resume,
                   save_extras=save_extras, console=console, meta=info, train_labels=rows.train_labels,
                   val_labels=rows.val_labels)
    if result.stopped == "interrupted" or not dist.is_main():  # under torchrun rank 0 publishes
        return result
    sweep_stale_staging(out)  # a killed run's half-published copy (out is locked, run_paths)
    tmp = None
    try:
        with write_errors(f"the adapter to {out}", f"free disk space; the run is kept in {run_dir}, publish it with "
                                                   "--resume"):
            tmp = staging_dir(out)
            save_adapter_weights(adapter, tmp)
            atomic_write_json(tmp / ADAPTER_JSON, json_for({"step": result.step, "stopped": result.stopped,
                                                            "last": result.last, "val": result.val}), "adapter config")
            publish_dir(tmp, out)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out = out
    return result
