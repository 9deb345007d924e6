"""A self-distilled block mode (spec/sbd_exact.md §5.5; issue 26 item 3).

Lossless SBD verifies the block mode's drafts against the model's own NTP mode, so the text the
block mode must predict is the model's greedy text, and the distribution it should match is the
NTP mode's. Trained on the model's own greedy continuations (a corpus from ``unmask data distill
--temperature 0``), the loss at every masked position t of the noisy half is

    CE(p_block(· | y_<t−j, masks), y_t) + λ · KL(p_NTP(· | y_<t) ‖ p_block(· | y_<t−j, masks))

where p_NTP is read from the clean half of the *same* forward (the position t − 1 of the clean
copy predicts y_t) and is a constant of the gradient (computed under ``no_grad``: neither the
trunk nor the shared LM head is pulled towards the student). For a gated adapter the clean half
is the untouched base, whose logits the trainer computes anyway. The NTP term of Eq. 14 (full
SBD) is unchanged, and the KL is summed over the masked targets and divided by the same target
count as the cross-entropy, so λ = 0 is exactly the plain objective.

The first position of a packed row has no clean position before it, so it gets the CE only.
The mask token's logit is dropped from both distributions (every decoder suppresses it).

:func:`check_distill_corpus` refuses data that is not a greedy self-distillation corpus of the
model being trained: the KL teacher and the CE targets must be the same model's greedy choice.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from unmask.errors import UnmaskError
from unmask.train.lm_loss import IGNORE, LOGITS_BUDGET, chunked_cross_entropy, head_weights
from unmask.train.sbd_loss import sbd_attention_mask

# λ of the KL term when --distill is given without --distill-lambda: of {0, 1, 2} in 40-step
# fine-tunes of stories260K-sbd (same corpus, seed and steps), λ = 1 gave the lowest held-out
# masked CE at offsets 0 and 1 (0.345 / 0.774 nats vs 0.388 / 0.806 at λ = 0, 0.357 / 0.784 at
# λ = 2); benchmarks/results/sbd_distill_lambda.md (benchmarks/sbd_distill.py --sweep).
DEFAULT_LAMBDA = 1.0


def check_lambda(lam: float) -> float:
    """``lam`` as a float when it is finite and >= 0; UnmaskError otherwise."""
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise UnmaskError(f"--distill-lambda must be a finite number >= 0, got {lam!r}; pass e.g. "
                          f"--distill-lambda {DEFAULT_LAMBDA:g}")
    return float(lam)


def _keep_ids(V: int, suppress: int | None, device) -> torch.Tensor | None:
    """(V-1,) the vocabulary without the mask token, or None when there is nothing to drop."""
    if suppress is None or not 0 <= suppress < V:
        return None
    keep = torch.ones(V, dtype=torch.bool, device=device)
    keep[suppress] = False
    return keep.nonzero().squeeze(1)  # (V-1,)


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                  suppress: int | None = None) -> torch.Tensor:
    """``KL(softmax(teacher) ‖ softmax(student))`` per row, in nats; the teacher is detached.

    Args:
        student_logits: (n, V) float logits (with grad when training).
        teacher_logits: (n, V) float logits; no gradient ever flows into them.
        suppress: a vocabulary id dropped from both distributions before normalising (the mask
            token), so the teacher's 0 there does not meet the student's log 0.

    Returns:
        (n,) float32, >= 0 up to rounding.
    """
    keep = _keep_ids(student_logits.shape[-1], suppress, student_logits.device)
    if keep is not None:
        student_logits, teacher_logits = student_logits[:, keep], teacher_logits[:, keep]  # (n, V-1) each
    log_t = F.log_softmax(teacher_logits.detach().float(), dim=-1)  # (n, V')
    log_s = F.log_softmax(student_logits.float(), dim=-1)  # (n, V')
    return (log_t.exp() * (log_t - log_s)).sum(-1)  # (n,)


def _rows_kl(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, teacher: torch.Tensor,
             suppress: int | None) -> torch.Tensor:
    return kl_to_teacher(F.linear(hidden, weight, bias), teacher, suppress)  # (c,)


def chunked_kl(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, weight: torch.Tensor, *,
               bias: torch.Tensor | None = None, suppress: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """:func:`kl_to_teacher` from final hidden states through the LM head, ``chunk`` rows at a time.

    The teacher's logits are formed under ``no_grad`` (the head is shared: a teacher path with
    grad would train the head towards the student); the student's chunks run in a checkpoint,
    so peak logits memory is O(chunk × V) as in :func:`unmask.train.lm_loss.chunked_cross_entropy`.

    Args:
        student_hidden, teacher_hidden: (n, d); weight: (V, d) LM head; bias: (V,) or None.

    Returns:
        (n,) float32 KL in nats, with grad to the student path only.
    """
    n, V = student_hidden.shape[0], weight.shape[0]
    chunk = max(1, LOGITS_BUDGET // V) if chunk is None else chunk
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (student_hidden, weight, bias))
    pieces = []
    for start in range(0, n, chunk):
        h = student_hidden[start : start + chunk]  # (c, d)
        with torch.no_grad():
            teacher = F.linear(teacher_hidden[start : start + chunk], weight, bias).float()  # (c, V)
        if grad:
            pieces.append(checkpoint(_rows_kl, h, weight, bias, teacher, suppress, use_reentrant=False,
                                     preserve_rng_state=False))
        else:
            pieces.append(_rows_kl(h, weight, bias, teacher, suppress))
    return torch.cat(pieces) if pieces else student_hidden.new_zeros(0, dtype=torch.float32)  # (n,)


def teacher_pairs(noisy_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which noisy positions get a teacher, and where it is.

    noisy_valid: (B, L) bool, the masked targets of the noisy half (position i scored on token i).
    Returns ``(student, teacher)``, both (B, L) bool with equal counts: ``student[b, i]`` for a
    target with i >= 1, ``teacher[b, i - 1]`` the clean position whose NTP logits predict the
    same token. Row-major gathers of both line up pair by pair.
    """
    student = noisy_valid.clone()
    student[:, 0] = False  # the first position of a row has no clean prefix to read p_NTP from
    teacher = F.pad(student[:, 1:], (0, 1))  # (B, L): clean i-1 for noisy i
    return student, teacher


def need_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head as ``(weight, bias)``; UnmaskError when it is not one linear map (an FSDP2
    shard, a logit soft-cap), where the teacher's logits cannot be formed from hidden states."""
    head = head_weights(model)
    if head is None:
        raise UnmaskError("--distill needs a plain linear LM head (not an FSDP-sharded model, a logit soft-cap or "
                          "scale); drop --fsdp (run single-process or DDP) or train without --distill")
    return head


def sbd_distill_loss(model, batch: dict, k: int, mask_id: int, lam: float) -> tuple[torch.Tensor, dict]:
    """SBD Eq. 14 plus the §5.5 KL term, from one forward over the 2L-token layout.

    ``(Σ CE over every target of both halves + λ Σ KL over the masked targets with a teacher) /
    (number of targets)``; λ = 0 equals :func:`unmask.train.sbd_loss.sbd_loss`.

    Args:
        model: a causal LM whose vocabulary contains ``mask_id``, with a linear LM head.
        batch: :func:`unmask.train.sbd_loss.sbd_batch` output (on the model's device); k its block size.
        lam: λ >= 0.

    Returns:
        ``(loss, terms)``: loss a scalar float32 with grad; terms ``ntp``, ``mat`` (mean CE of
        each half), ``kl`` (mean KL per masked target with a teacher) and the token counts.

    Raises:
        UnmaskError: ``mask_id`` outside the vocabulary, or a head :func:`need_head` refuses.
    """
    from unmask.compat import final_hidden

    L, V = batch["L"], model.config.vocab_size
    if not 0 <= mask_id < V:
        raise UnmaskError(f"mask_token_id {mask_id} is outside the model vocabulary of {V}; pass a mask token id "
                          "below the vocabulary size")
    weight, bias = need_head(model)
    ids, labels = batch["input_ids"], batch["labels"]  # (B, 2L) each
    B = ids.shape[0]
    attn = sbd_attention_mask(model, L, k, ids.device).expand(B, -1, -1, -1)  # (B, 1, 2L, 2L)
    hidden = final_hidden(model, ids, position_ids=batch["position_ids"], attention_mask=attn)  # (B, 2L, d)
    valid = labels != IGNORE  # (B, 2L)
    nll = chunked_cross_entropy(hidden[valid], weight, labels[valid], bias=bias, suppress=mask_id)  # (n,)
    per_pos = torch.zeros(labels.shape, dtype=torch.float32, device=ids.device).masked_scatter(valid, nll)  # (B, 2L)
    student, teacher = teacher_pairs(valid[:, L:])  # (B, L) each
    kl = chunked_kl(hidden[:, L:][student], hidden[:, :L][teacher], weight, bias=bias, suppress=mask_id)  # (m,)
    n_ntp, n_mat = valid[:, :L].sum(), valid[:, L:].sum()
    loss = (nll.sum() + lam * kl.sum()) / (n_ntp + n_mat).clamp(min=1)
    with torch.no_grad():
        terms = {"ntp": per_pos[:, :L].sum() / n_ntp.clamp(min=1), "mat": per_pos[:, L:].sum() / n_mat.clamp(min=1),
                 "kl": kl.sum() / max(1, kl.numel()), "ntp_tokens": n_ntp, "mat_tokens": n_mat}
    return loss, terms


def check_distill_options(distill: bool, distill_lambda: float | None, answer_only: bool | None,
                          fsdp: bool) -> float | None:
    """λ of a ``distill`` run (None without it); UnmaskError for a combination that cannot work:
    ``distill_lambda`` without ``distill``, a negative or non-finite λ, ``answer_only=False``
    (a prompt token is not the model's own continuation) or FSDP (the teacher's logits need the
    whole LM head)."""
    if not distill:
        if distill_lambda is not None:
            raise UnmaskError("--distill-lambda weighs the KL term of --distill; pass --distill too, or drop "
                              "--distill-lambda")
        return None
    lam = check_lambda(DEFAULT_LAMBDA if distill_lambda is None else distill_lambda)
    if answer_only is False:
        raise UnmaskError("--distill trains on the model's own continuations, not on the prompts; drop "
                          "--no-answer-only")
    if fsdp:
        raise UnmaskError("--distill needs the whole LM head on every process for the teacher's logits; drop "
                          "--fsdp (DDP under torchrun works)")
    return lam


def check_distill_corpus(paths: Sequence[str | os.PathLike], base: str, *, adapter: str | None = None) -> dict:
    """Refuse data that is not a greedy self-distillation corpus of ``base`` (module docstring).

    Every line of every file must be a row of ``unmask data distill`` (``ids``, ``loss_start``
    and ``settings``) written with temperature 0 by the model ``base`` (the name or directory
    passed to the trainer; directories compare by resolved path) and the given ``adapter``
    (None for an SBD fine-tune or for a gated adapter, whose teacher is the plain base).

    Returns the common settings. Raises UnmaskError naming the file, the line and the fix.
    """
    make = (f"make it with 'unmask data distill --model {base} --temperature 0 --prompts FILE --out CORPUS.jsonl'")

    from unmask.models.registry import resolve

    def where(name: str) -> Path | None:
        try:
            return Path(resolve(name)[1]).resolve()
        except (UnmaskError, OSError, TypeError):
            return None

    def same_model(a: str) -> bool:  # a shipped name and its directory are the same model
        return a == base or (where(a) is not None and where(a) == where(base))

    first = None
    for path in paths:
        path = Path(path)
        if path.suffix.lower() != ".jsonl":
            raise UnmaskError(f"--distill trains on the model's own greedy continuations, and {path} is not a .jsonl "
                              f"distillation corpus; {make}")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UnmaskError(f"cannot read {path} ({e}); pass a readable distillation corpus") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UnmaskError(f"{path} line {n} is not JSON; {make}") from None
            settings = row.get("settings") if isinstance(row, dict) else None
            if not isinstance(settings, dict) or "loss_start" not in row:
                raise UnmaskError(f"{path} line {n} is not a self-distillation row (no settings/loss_start), so "
                                  f"--distill has no greedy continuation to train on; {make}")
            if settings.get("temperature") != 0:
                raise UnmaskError(f"{path} line {n} was sampled at temperature {settings.get('temperature')}, and "
                                  f"--distill needs greedy continuations; {make}")
            if not isinstance(settings.get("model"), str) or not same_model(settings["model"]):
                raise UnmaskError(f"{path} line {n} holds continuations of {settings.get('model')!r}, not of the "
                                  f"model being trained ({base!r}); {make}")
            if settings.get("adapter") != adapter:
                raise UnmaskError(f"{path} line {n} was decoded with adapter {settings.get('adapter')!r}; the "
                                  f"teacher is {base!r} without an adapter, {make}")
            first = first or settings
    if first is None:
        raise UnmaskError(f"the --distill data holds no rows; {make}")
    return first


def make_story_distill_corpus(out: str | os.PathLike, *, model: str, n_prompts: int = 2000, seed: int = 0,
                              max_new_tokens: int = 192, batch_size: int = 128, exclude: Sequence[str] | None = None,
                              progress=None) -> dict:
    """A ``--distill`` corpus for a stories model: ``model``'s greedy continuations (temperature 0,
    ``unmask data distill``) of story openings sampled from it (:func:`unmask.train.data.story_prompts`).

    The openings go to ``OUT.prompts.jsonl`` (reused when present, so a rerun decodes the same
    prompts); ``exclude`` defaults to the held-out benchmark openings
    (:data:`unmask.eval.story_openings.STORY_OPENINGS`), so the measured text is never trained on.
    An existing complete ``out`` is reused (``resume``). Returns the :func:`distill` summary.
    """
    from unmask.eval.story_openings import STORY_OPENINGS
    from unmask.fileio import atomic_write_text
    from unmask.models import load
    from unmask.train.data import story_prompts
    from unmask.train.distill import distill

    out = Path(out)
    prompts = out.with_name(out.stem + ".prompts.jsonl")
    if not prompts.is_file():
        bundle = load(model)
        texts = story_prompts(bundle, n_prompts, seed=seed, exclude=STORY_OPENINGS if exclude is None else exclude,
                              batch_size=batch_size)
        atomic_write_text(prompts, "".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return distill(out, model=model, prompts=[prompts], max_new_tokens=max_new_tokens, batch_size=batch_size,
                   temperature=0.0, seed=seed, resume=out.exists(), progress=progress)
