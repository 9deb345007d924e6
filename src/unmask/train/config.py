"""A training run's settings and outcome: :class:`TrainConfig` (frozen, validated: the optimizer,
schedule, batch, checkpoint and stop settings of :func:`unmask.train.loop.train`), which of them a
resume may change (:func:`check_resumable`), and :class:`TrainResult`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from unmask.errors import UnmaskError

# Options that may change between a run and its resume; all others must match the checkpoint.
RESUMABLE = ("steps", "ckpt_every", "eval_every", "eval_batches", "log_every", "keep_checkpoints", "max_minutes",
             "fsdp")
# TrainConfig fields that the training commands expose as --flags (named so in messages).
FLAG_OPTIONS = ("lr", "warmup", "steps", "batch_size", "grad_accum", "weight_decay", "clip", "ckpt_every",
                "eval_every", "log_every", "keep_checkpoints", "max_minutes", "seed", "fsdp")
# Bounds past which an option is refused as absurd (TrainConfig.__post_init__ says why).
MAX_LR = 1.0
MAX_STEPS = 100_000_000
MAX_BATCH = 65_536
_INT_FIELDS = ("warmup", "steps", "batch_size", "grad_accum", "ckpt_every", "eval_every", "eval_batches", "log_every",
               "keep_checkpoints", "seed")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}" if name in FLAG_OPTIONS else name


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of one run.

    lr: peak learning rate; warmup: linear warm-up steps; steps: optimizer steps in total;
    min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``. batch_size: sequences per
    micro-batch (per process); grad_accum: micro-batches per optimizer step and process, so a
    step sees ``batch_size · grad_accum · world`` sequences under torchrun. fsdp: shard the model
    with FSDP2 instead of replicating it with DDP (only under torchrun). weight_decay applies to
    parameters of rank >= 2 only. clip: max global grad norm (0 = off). ckpt_every /
    eval_every / log_every: in optimizer steps (0 = only at the end / never / never).
    eval_batches: validation micro-batches per evaluation. keep_checkpoints: newest checkpoints
    kept. max_minutes: wall-clock budget of this invocation; when the next step would exceed
    it, training stops, checkpoints and returns (None = no budget).

    Raises UnmaskError for a value of the wrong type or out of range, including the bounds past
    which a setting is a typo: lr in (0, MAX_LR], lr · weight_decay < 1, steps and warmup <=
    MAX_STEPS, batch_size, grad_accum and eval_batches <= MAX_BATCH, seed in [0, 2**63).
    """

    lr: float = 3e-4
    warmup: int = 100
    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    min_lr_ratio: float = 0.1
    ckpt_every: int = 500
    eval_every: int = 500
    eval_batches: int = 4
    log_every: int = 10
    keep_checkpoints: int = 1
    seed: int = 0
    max_minutes: float | None = None
    fsdp: bool = False

    def __post_init__(self):
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UnmaskError(f"{_flag(name)} must be an integer, got {value!r}; pass a whole number")
        for name in ("lr", "weight_decay", "clip", "min_lr_ratio", "max_minutes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UnmaskError(f"{_flag(name)} must be a number, got {value!r}; pass a number")
        if not isinstance(self.betas, (tuple, list)) or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) for b in self.betas):
            raise UnmaskError(f"betas must be two numbers, got {self.betas!r}; pass e.g. betas=(0.9, 0.95)")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        for name in ("lr", "weight_decay", "clip", "min_lr_ratio", "max_minutes"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                flag = f"--{name.replace('_', '-')}" if name in FLAG_OPTIONS else name
                raise UnmaskError(f"{flag} must be a finite number, got {value}; pass a finite value")
        if not all(math.isfinite(b) for b in self.betas):
            raise UnmaskError(f"betas must be finite, got {self.betas}; pass e.g. betas=(0.9, 0.95)")
        checks = [
            (self.lr > 0, f"--lr must be > 0, got {self.lr}; pass a positive learning rate, e.g. --lr 3e-4"),
            (self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}; pass --warmup 0 or more"),
            (self.steps >= 1, f"--steps must be >= 1, got {self.steps}; pass --steps 1 or more"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}; pass --batch-size 1 or more"),
            (self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}; pass --grad-accum 1 or more"),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}; "
                                     "pass --weight-decay 0 or more"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             f"betas must be two values in [0, 1), got {self.betas}; pass e.g. betas=(0.9, 0.95)"),
            (self.clip >= 0, f"--clip must be >= 0 (0 = off), got {self.clip}; pass --clip 0 or more"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}; "
                                          "pass a value between 0 and 1"),
            (self.ckpt_every >= 0, f"--ckpt-every must be >= 0, got {self.ckpt_every}; "
                                   "pass --ckpt-every 0 (only at the end) or more"),
            (self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}; "
                                   "pass --eval-every 0 (only at the end) or more"),
            (self.log_every >= 0, f"--log-every must be >= 0, got {self.log_every}; pass 0 (never) or more"),
            (self.eval_batches >= 1, f"eval_batches must be >= 1, got {self.eval_batches}; pass 1 or more"),
            (self.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}; "
                                         "pass 1 or more"),
            (self.max_minutes is None or self.max_minutes > 0, f"--max-minutes must be > 0, got {self.max_minutes}; "
                                                               "pass a positive budget or leave it out"),
            # Upper bounds (issue 28): beyond them a run is a typo, not a setting. AdamW moves every
            # weight by about lr per step, so lr > 1 destroys any model in one step (lr 1e30 published
            # weights of 1e30 whose logits were all equal); decoupled decay multiplies each weight by
            # (1 - lr·wd) per step, which for lr·wd >= 1 zeroes or flips it.
            (self.lr <= MAX_LR, f"--lr {self.lr:g} is above {MAX_LR:g} (AdamW moves every weight by about lr per "
                                "step); pass a learning rate such as --lr 3e-4"),
            (self.lr * self.weight_decay < 1, f"--lr {self.lr:g} x --weight-decay {self.weight_decay:g} is >= 1, so "
                                              "each step would zero or flip every weight; lower --weight-decay"),
            (self.steps <= MAX_STEPS, f"--steps {self.steps} is above {MAX_STEPS:,}; pass a realistic step count "
                                      "(--max-minutes bounds a run by time)"),
            (self.warmup <= MAX_STEPS, f"--warmup {self.warmup} is above {MAX_STEPS:,}; pass a warm-up shorter "
                                       "than the run"),
            (self.batch_size <= MAX_BATCH, f"--batch-size {self.batch_size} is above {MAX_BATCH:,} sequences per "
                                           "micro-batch; pass a smaller one and raise --grad-accum"),
            (self.grad_accum <= MAX_BATCH, f"--grad-accum {self.grad_accum} is above {MAX_BATCH:,}; pass a "
                                           "smaller one"),
            (self.eval_batches <= MAX_BATCH, f"eval_batches {self.eval_batches} is above {MAX_BATCH:,}; pass a "
                                             "smaller one"),
            (0 <= self.seed < 2**63, f"--seed must be in [0, 2**63), got {self.seed}; pass e.g. --seed 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise UnmaskError(message)

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` for optimizer step ``step`` (0-based): linear warm-up to 1 over
        ``warmup`` steps, then cosine decay to ``min_lr_ratio`` at ``steps``."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    """What :func:`train` did. stopped: ``done`` (all steps), ``time`` (max_minutes reached) or
    ``interrupted`` (SIGINT/SIGTERM; a checkpoint was saved). last: mean terms of the last log
    interval; val: the last evaluation (None without validation data); out: the exported model
    directory, set by the caller that publishes one. signal: the signal that stopped an
    interrupted run (SIGINT when the request came from another rank), else None."""

    step: int
    stopped: str
    seconds: float
    checkpoint: Path | None
    last: dict = field(default_factory=dict)
    val: dict | None = None
    out: Path | None = None
    signal: int | None = None


def check_resumable(saved: dict, config: TrainConfig, ckpt: Path, saved_world: int = 1, world: int = 1) -> None:
    """Refuse a resume whose settings differ from the checkpoint's, except RESUMABLE ones. The
    world size may change when ``world · grad_accum`` (micro-batches per step) stays the same."""
    now = asdict(config)
    theirs, mine = saved_world * saved.get("grad_accum", 1), world * config.grad_accum
    if theirs != mine:
        fix = (f"pass --grad-accum {theirs // world}" if theirs % world == 0 else
               f"run on a number of processes that divides {theirs}")
        raise UnmaskError(f"{ckpt} was trained with {saved_world} process(es) x --grad-accum {saved.get('grad_accum', 1)}"
                          f" = {theirs} micro-batches per step, this run has {world} x {config.grad_accum}; {fix}, "
                          "or pass --overwrite to start over")
    for key, value in saved.items():
        if key in RESUMABLE or key == "grad_accum" or key not in now:
            continue
        mine = list(now[key]) if isinstance(now[key], tuple) else now[key]
        theirs = list(value) if isinstance(value, tuple) else value
        if mine != theirs:
            name = f"--{key.replace('_', '-')}" if key in FLAG_OPTIONS else key
            raise UnmaskError(f"{ckpt} was trained with {name}={theirs!r}, not {mine!r}; resume with the same "
                              "settings or pass --overwrite to start over")
