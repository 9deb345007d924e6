"""A generic, resumable training loop: AdamW, warm-up + cosine, accumulation, atomic checkpoints.

Objective-agnostic: anything with ``name``, ``term_names``, ``step_params(generator) -> dict``
(draws shared by the micro-batches of one optimizer step, e.g. SBD's block size) and
``loss(model, chunks, generator, **params) -> (loss, terms)`` plugs in (SBD here; masked and
block diffusion later). With label masks (answer-only training, ``train(..., train_labels=...)``)
the loss is called with ``labels=`` (B, L+1) bool as well. An objective may also define
``diagnostics(model, chunks, labels) -> dict`` of extra validation numbers (SBD's masked CE per
block offset), averaged over the validation batches and logged with the validation loss.

Run directory layout::

    run_dir/checkpoints/step-00001200/   model.safetensors, config.json, ... (loadable HF dir,
                                         plus whatever ``save_extras`` adds) + trainer_state.pt
                                         + dcp/ (model and optimizer, torch.distributed.checkpoint)
    run_dir/log.jsonl                    one line per log interval and per evaluation

A checkpoint is assembled in a hidden staging directory and renamed into place, so a
``step-*`` directory is always complete; a crash or kill at any moment leaves the previous one.

Exact resume: the optimizer, scheduler, step, data order and every RNG the loop draws from are
saved (the objective's noise comes from generators seeded by seed, step and micro-batch); N
steps straight and N/2 + resume + N/2 give bit-identical fp32 parameters on CPU.

Under ``torchrun`` the same loop runs data-parallel (DDP, or FSDP2 with ``fsdp``), with rank-0
progress, logs and checkpoint exports; :mod:`unmask.train.parallel` describes the global step
and the distributed checkpoints.

We use plain PyTorch rather than ``accelerate.Accelerator``: accumulation is a few lines, and
Accelerator's process-global state and its own RNG/dataloader wrapping would stand between us
and the exact-resume guarantee above.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.train.checkpoint import (  # noqa: F401  (re-exported: the checkpoint API predates the split)
    CKPT_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
    checkpoints,
    diverged,
    exploded,
    latest_checkpoint,
    load_state,
    load_weights,
    save_checkpoint,
    save_model,
)
from unmask.train.config import TrainConfig, TrainResult, check_resumable  # noqa: F401 (public here too)
from unmask.train.documents import ChunkSampler
from unmask.train.progress import TrainProgress


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def build_optimizer(model, config: TrainConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (decay on rank >= 2 parameters only) and the warm-up + cosine LambdaLR."""
    decay, no_decay = [], []
    for p in model.parameters():  # tied parameters are yielded once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, config.lr_factor)
    return opt, sched


@torch.no_grad()
def evaluate(model, objective, chunks: torch.Tensor, config: TrainConfig, device,
             labels: torch.Tensor | None = None) -> dict:
    """Mean loss and terms (and the objective's ``diagnostics``, if it has them) over
    ``eval_batches`` micro-batches of validation rows.

    chunks: (M, L+1) validation rows in corpus order; labels: their (M, L+1) bool label masks
    (answer-only training) or None. The rows are taken evenly spaced over all
    M (all of them when M ≤ eval_batches · batch_size), so a corpus whose documents are grouped
    by source (e.g. sampled stories first, greedy continuations after) is scored on its whole
    mixture, not on its first source. A fixed generator makes every evaluation draw the same
    noise, so values are comparable across steps and runs. The training RNG streams are not
    touched.
    """
    g = torch.Generator().manual_seed(config.seed + 7919)
    want = config.eval_batches * config.batch_size
    if len(chunks) > want:
        rows = torch.linspace(0, len(chunks) - 1, want).round().long()  # (want,)
        chunks = chunks[rows]  # (want, L+1)
        labels = None if labels is None else labels[rows]  # (want, L+1)
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    n = 0
    diagnose = getattr(objective, "diagnostics", None)
    for i in range(config.eval_batches):
        batch = chunks[i * config.batch_size : (i + 1) * config.batch_size].to(device)
        if len(batch) == 0:
            break
        extra = {} if labels is None else {"labels": labels[i * config.batch_size : (i + 1) * config.batch_size]
                                                     .to(device)}
        params = objective.step_params(g)
        loss, terms = objective.loss(model, batch, g, **params, **extra)
        values = {"loss": loss, **{t: terms[t] for t in objective.term_names}}
        if diagnose is not None:
            values.update(diagnose(model, batch, extra.get("labels")))
        for name, value in values.items():
            sums[name] = sums.get(name, 0.0) + float(value)
        n += 1
    model.train(was_training)
    return {name: value / max(1, n) for name, value in sums.items()}


class _StopFlag:
    """SIGINT/SIGTERM -> finish the current step, checkpoint, return. A second signal raises.

    ``signum`` is the first signal's number. A request the loop never acted on (:meth:`take`
    read the flag before it came) is delivered again on leaving, to the handlers of the caller,
    so that no signal is lost between the last step and the end of the block."""

    def __init__(self):
        self.set = False
        self.signum: int | None = None
        self._taken = False
        self._old = {}

    def _handle(self, signum, frame):
        self.set = True
        self.signum = self.signum or signum
        for sig, old in self._old.items():  # a second Ctrl-C interrupts at once
            signal.signal(sig, old)

    def take(self) -> bool:
        """Whether a stop was requested; once it was, the loop acts on it."""
        self._taken = self._taken or self.set
        return self.set

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type, *exc):
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old.items():
                signal.signal(sig, old)
            if self.set and not self._taken and exc_type is None:
                signal.raise_signal(self.signum)  # e.g. KeyboardInterrupt: the command ends interrupted
        return False


def _note(console, message: str) -> None:
    """One line on the progress console (stderr) if there is one, else on stderr."""
    if console is not None:
        console.print(message, highlight=False, markup=False, soft_wrap=True)
    else:
        print(message, file=sys.stderr, flush=True)


def _zero_link(model) -> torch.Tensor:
    """0, with a gradient path to every trainable parameter (their gradients are zero)."""
    terms = [p.sum() * 0 for p in model.parameters() if p.requires_grad]
    return sum(terms[1:], terms[0]) if terms else torch.zeros(())


def train(model, objective, train_chunks: torch.Tensor, val_chunks: torch.Tensor | None, config: TrainConfig,
          run_dir: str | Path, *, device: str | torch.device = "cpu", resume: bool = False,
          save_extras: Callable[[Path, dict], None] | None = None, console=None, meta: dict | None = None,
          train_labels: torch.Tensor | None = None, val_labels: torch.Tensor | None = None) -> TrainResult:
    """Train ``model`` in place on packed chunks with ``objective``.

    Args:
        model: an HF ``PreTrainedModel`` (trained in its current dtype).
        objective: see the module docstring.
        train_chunks: (N, L+1) long, on CPU; val_chunks: (M, L+1) long or None.
        run_dir: checkpoints and ``log.jsonl`` go here.
        resume: continue from the newest checkpoint in ``run_dir`` (weights, optimizer,
            scheduler, step, data order, RNGs); starts fresh, with a note on the console (or
            stderr), when there is none.
        save_extras: called on every checkpoint directory (tokenizer, metadata).
        console: a ``rich.console.Console`` for the progress bar (None = quiet).
        meta: JSON-able facts stored in each checkpoint's trainer state (e.g. the data files).
        train_labels / val_labels: (N, L+1) / (M, L+1) bool label masks of the chunks (True =
            loss target; answer-only training), passed to the objective as ``labels=``; None =
            every token is a target and the objective is called without ``labels``.

    Returns:
        TrainResult. The model is left in training mode with the final weights.

    Raises:
        UnmaskError: a micro-batch that cannot fit in the memory free on ``device``
            (:func:`unmask.memory.train_bytes_per_sequence`, a lower bound), empty data, a
            checkpoint whose settings or data do not match, or a run that
            diverged: a non-finite loss, a trained weight that is not finite or beyond float16's
            range (:func:`unmask.train.checkpoint.weight_problem`), or a final loss that exploded
            (:func:`unmask.train.checkpoint.exploded`); nothing is then saved or published.
    """
    from unmask import dist, memory
    from unmask.train import parallel

    device = dist.setup(device)
    run_dir = Path(run_dir)
    main = dist.is_main()
    console = console if main else None
    model.to(device).train()
    seq_len = int(train_chunks.shape[-1]) - 1
    memory.check(config.batch_size, memory.train_bytes_per_sequence(model, seq_len), device,
                 what=f"a {seq_len}-token training sequence", flag="--batch-size",
                 fix=lambda fit: f"lower --batch-size (more than {fit} cannot fit) or --seq-len, and raise "
                                 "--grad-accum to keep the sequences per step")
    wrapped = parallel.wrap(model, fsdp=config.fsdp, device=device)
    opt, sched = build_optimizer(wrapped, config)
    sampler = ChunkSampler(len(train_chunks), config.seed)
    world, n_micro = dist.world(), dist.world() * config.grad_accum
    mine = parallel.owned(n_micro)  # global micro-batch indices this rank computes
    step = 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    parallel.check_same_inputs(train_chunks, ckpt)
    if resume and ckpt is None and main:
        _note(console, f"note: --resume found no checkpoint in {run_dir}; training starts from scratch")
    if config.fsdp and world == 1:
        _note(console, "note: --fsdp shards the model only under torchrun; training in one process")
    if ckpt is not None:
        state = load_state(ckpt)
        check_resumable(state["config"], config, ckpt, int(state.get("world_size", 1)), world)
        if bool(state.get("labelled", False)) != (train_labels is not None):  # answer-only on one side only
            was = "with" if state.get("labelled") else "without"
            raise UnmaskError(f"{ckpt} was trained {was} answer-only labels; resume with the same --answer-only "
                              "setting and data, or pass --overwrite to start over")
        try:
            if parallel.has_dcp(ckpt):
                parallel.load_checkpoint(ckpt, wrapped, opt)
            elif world == 1 and "optimizer" in state:  # written before distributed checkpoints
                load_weights(model, ckpt)
                opt.load_state_dict(state["optimizer"])
            else:
                raise UnmaskError(f"{ckpt} has no distributed checkpoint ({parallel.DCP_DIR}/) to resume {world} "
                                  "processes from; resume it in one process, or pass --overwrite")
            sched.load_state_dict(state["scheduler"])
            sampler.load_state_dict(state["sampler"])
            torch.set_rng_state(state["rng"]["torch"])
            if torch.cuda.is_available() and state["rng"].get("cuda") is not None and world == 1:
                torch.cuda.set_rng_state_all(state["rng"]["cuda"])
            step = int(state["step"])
        except UnmaskError:
            raise
        except BaseException as e:  # noqa: BLE001 - incl. torch.distributed.checkpoint's CheckpointException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:100]
            raise UnmaskError(f"{ckpt} does not fit this run or is damaged ({type(e).__name__}: {first}); "
                              "delete the checkpoint or pass --overwrite to start over") from None
    has_val = val_chunks is not None and len(val_chunks) > 0
    if has_val and val_labels is not None and not bool(val_labels.any()):
        has_val = False  # scoring rows without a target would report a loss of 0
        if main:
            warnings.warn("the validation rows hold no answer token at this --seq-len (packing cut them off), so "
                          "this run reports no validation numbers; raise --seq-len or the validation share")
    elif not has_val and main and config.eval_every > 0:
        warnings.warn("no validation row fills --seq-len tokens, so this run reports no validation numbers; "
                      "lower --seq-len or add held-out data")
    val, val_step, last, first_loss = None, None, {}, None
    if ckpt is not None:
        val, last, first_loss = state.get("val"), state.get("last") or {}, state.get("first_loss")
        val_step = step if val is not None else None

    def trainer_state(stopped: str) -> dict:
        return {
            "step": step, "stopped": stopped, "config": asdict(config), "objective": objective.name,
            "world_size": world, "scheduler": sched.state_dict(), "sampler": sampler.state_dict(),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "val": val, "last": last, "meta": json.dumps(meta or {}), "labelled": train_labels is not None,
            "first_loss": first_loss,
        }

    def checkpoint(stopped: str) -> None:
        parallel.save_checkpoint(run_dir, step, wrapped, opt, trainer_state(stopped), save_extras,
                                 config.keep_checkpoints)

    def validate() -> dict:  # every rank scores the same rows (FSDP2 needs them all in the forward)
        return evaluate(parallel.eval_model(wrapped), objective, val_chunks, config, device, val_labels)

    log_path = run_dir / "log.jsonl"
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)

    def log(record: dict) -> None:
        if main:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    t_start = time.monotonic()
    budget = None if config.max_minutes is None else 60 * config.max_minutes
    saved_at = step if ckpt is not None else None
    names = ("loss", *objective.term_names)
    window: dict[str, float] = {}
    window_steps, window_tokens, window_t0 = 0, 0, time.monotonic()
    stopped, flags = "done", (0.0, 0.0)
    progress = TrainProgress(console, config.steps, step, objective.term_names)
    with _StopFlag() as stop, progress:
        while step < config.steps:
            # Decided on the flags every rank summed after the last step, so all ranks stop together.
            if flags[0] > 0:
                stopped = "interrupted"
                break
            if flags[1] > 0:
                stopped = "time"
                break
            t0 = time.monotonic()
            params = objective.step_params(parallel.micro_generator(config.seed, step, -1))
            opt.zero_grad(set_to_none=True)
            local = torch.zeros(len(names) + 3, dtype=torch.float64)  # term sums, tokens, stop, time
            for m in range(n_micro):
                index = sampler.next(config.batch_size)  # every rank walks the global stream
                if m not in mine:
                    continue
                chunks = train_chunks[index].to(device)  # (B, L+1)
                extra = {} if train_labels is None else {"labels": train_labels[index].to(device)}  # (B, L+1)
                with parallel.no_sync(wrapped, last=m == mine[-1]):
                    loss, terms = objective.loss(wrapped, chunks, parallel.micro_generator(config.seed, step, m),
                                                 **params, **extra)
                    if not bool(torch.isfinite(loss.detach()).all()):  # before it reaches the weights
                        raise diverged(f"the loss is {float(loss.detach())}", step + 1, run_dir)
                    if not loss.requires_grad:  # a micro-batch with no target (no answer token, no mask):
                        loss = loss + _zero_link(wrapped)  # zero gradients, and every DDP rank still syncs
                    (loss / config.grad_accum).backward()
                local[0] += float(loss.detach()) / n_micro
                for i, name in enumerate(objective.term_names, start=1):
                    local[i] += float(terms[name]) / n_micro
                local[-3] += chunks.shape[0] * (chunks.shape[1] - 1)
            if config.clip > 0:
                torch.nn.utils.clip_grad_norm_(wrapped.parameters(), config.clip)
            opt.step()
            sched.step()
            step += 1
            step_seconds = time.monotonic() - t0  # the next step would end past the budget: stop now
            local[-2] = float(stop.take())
            local[-1] = float(budget is not None and time.monotonic() - t_start + step_seconds > budget)
            total = dist.all_reduce_sum(local)  # global means, tokens and any rank's stop request
            sums = dict(zip(names, total[: len(names)].tolist()))
            if first_loss is None:  # the untrained model's loss, the reference of the explosion check
                first_loss = sums["loss"]
            window_tokens += int(total[-3])
            flags = (float(total[-2]), float(total[-1]))
            for name, value in sums.items():
                window[name] = window.get(name, 0.0) + value
            window_steps += 1
            if (config.log_every and step % config.log_every == 0) or step == config.steps:
                elapsed = time.monotonic() - window_t0
                last = {name: value / window_steps for name, value in window.items()}
                last["tok_s"] = window_tokens / max(elapsed, 1e-9)
                last["steps_s"] = window_steps / max(elapsed, 1e-9)
                log({"step": step, "lr": sched.get_last_lr()[0], **last, "world": world,
                     "elapsed_s": time.monotonic() - t_start})
                window, window_steps, window_tokens, window_t0 = {}, 0, 0, time.monotonic()
            if has_val and config.eval_every and step % config.eval_every == 0:
                val, val_step = validate(), step
                log({"step": step, **{f"val_{k}": v for k, v in val.items()}})
                progress.note(step, val)
            progress.update(step, sums, last.get("tok_s"))
            if config.ckpt_every and step % config.ckpt_every == 0:
                checkpoint("checkpoint")
                saved_at = step
        if flags[0] > 0:  # a stop requested during the last step: the run ends interrupted, unpublished
            stopped = "interrupted"
        if has_val and val_step != step and stopped != "interrupted":
            val, val_step = validate(), step
            log({"step": step, **{f"val_{k}": v for k, v in val.items()}})
        final = (val or last).get("loss")
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if stopped != "interrupted" and exploded(first_loss, final, vocab if isinstance(vocab, int) else None):
            which = "held-out" if val else "training"
            raise diverged(f"the {which} loss ended at {final:.4g}, more than ln V = {math.log(vocab):.2f} (a uniform "
                           f"guess over the vocabulary) above the untrained model's {first_loss:.4g}"
                           if math.isfinite(final) else f"the {which} loss ended at {final}", step, run_dir)
        if stop.take() and stopped != "interrupted":  # Ctrl-C during the final checks: nothing is published
            stopped = "interrupted"
        if saved_at != step:
            checkpoint(stopped)
    log({"step": step, "stopped": stopped, "seconds": time.monotonic() - t_start})
    return TrainResult(step=step, stopped=stopped, seconds=time.monotonic() - t_start,
                       checkpoint=latest_checkpoint(run_dir), last=last, val=val,
                       signal=(stop.signum or signal.SIGINT) if stopped == "interrupted" else None)
