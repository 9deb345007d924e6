"""Data-parallel training under torchrun for :func:`unmask.train.loop.train`: DDP or FSDP2
wrapping, the deterministic micro-batch plan, and distributed checkpoints.

**Global step.** One optimizer step consumes ``M = world · grad_accum`` micro-batches of
``batch_size`` rows (``batch_size`` is per process, as torchrun users expect). Every rank draws
the same global stream of chunk indices from the shared :class:`~unmask.train.documents.ChunkSampler`
and keeps the micro-batches ``m`` with ``m % world == rank``; micro-batch ``m`` of step ``s``
draws its noise from its own generator seeded by ``(seed, s, m)``. Each micro-batch loss is
divided by ``M`` and DDP/FSDP average the gradients over ranks, so the step equals a single
process with ``grad_accum = M`` on the same global batch (to float rounding), and a run resumes
on another world size with the same ``world · grad_accum``.

**Checkpoints.** ``step-*/dcp/`` holds the model and optimizer state written by
``torch.distributed.checkpoint`` (each rank writes its shards; loading reshards to the current
world size); rank 0 adds the Hugging Face export (the full state dict gathered once), the
tokenizer extras and ``trainer_state.pt``. The staging directory is renamed into place only
after every rank has written, so the atomic-publish guarantee of one process holds.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from unmask import dist
from unmask.errors import UnmaskError
from unmask.fileio import staging_dir
from unmask.fileio import write_errors
from unmask.train.checkpoint import CKPT_DIR, STATE_FILE, diverged, install, prune, save_model, weight_problem

DCP_DIR = "dcp"


def micro_generator(seed: int, step: int, micro: int) -> torch.Generator:
    """The CPU generator of micro-batch ``micro`` (0-based, global) of optimizer step ``step``;
    ``micro = -1`` is the per-step draw (``objective.step_params``). Pure in its arguments, so any
    rank, world size or resumed run draws the same noise for the same micro-batch."""
    digest = hashlib.sha256(f"unmask-train:{seed}:{step}:{micro}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def owned(n_micro: int) -> list[int]:
    """Global micro-batch indices this rank computes (``m % world == rank``)."""
    return dist.batch_shard(n_micro)


def check_same_inputs(train_chunks: torch.Tensor, checkpoint: Path | None) -> None:
    """Refuse to train when the ranks read different data or see different checkpoints (e.g. a
    run directory that is not on a filesystem shared by every node): the global micro-batch plan
    assumes every rank holds the same rows. One gather of a cheap fingerprint; a no-op alone.

    Raises:
        UnmaskError: on every rank, naming what differs.
    """
    if not dist.active():
        return
    rows = train_chunks.long()
    data = (tuple(rows.shape), int(rows.sum()), int((rows[:, :1] * torch.arange(1, len(rows) + 1)[:, None]).sum()))
    seen = dist.gather_ordered([(dist.rank(), (data, None if checkpoint is None else checkpoint.name))])
    if len({d for d, _ in seen}) > 1:
        raise UnmaskError("the training processes packed different training data; give every process the same "
                          "--data files (on a shared filesystem or identical copies) and --seq-len")
    if len({c for _, c in seen}) > 1:
        found = ", ".join(f"rank {r}: {c or 'none'}" for r, (_, c) in enumerate(seen))
        raise UnmaskError(f"the training processes see different checkpoints to resume ({found}); put --run-dir on a "
                          "filesystem every node shares")


class _DDP(torch.nn.parallel.DistributedDataParallel):
    """DDP whose unknown attributes (``config``, ``get_input_embeddings``, ...) come from the
    wrapped model, so objectives written for a plain HF model run on it unchanged; calling it
    still goes through DDP's forward, which arms the gradient all-reduce."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks FSDP2 shards one by one: the ``ModuleList`` of the HF base model
    (``model.model.layers`` for Llama/Qwen-style LMs), else every module whose class name ends
    in ``DecoderLayer``/``Block``."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    return [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))]


def wrap(model, *, fsdp: bool, device: torch.device):
    """``model`` ready for data-parallel training: unchanged in one process, DDP (default) or
    FSDP2 (``fully_shard`` on every decoder layer, then the root) under torchrun. FSDP2 uses
    bf16 parameters with fp32 gradient reduction on a CUDA device that supports bf16, plain fp32
    elsewhere (CPU/gloo). Build the optimizer after this call."""
    if not dist.active():
        return model
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy()
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    return _DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def inner(model):
    """The HF model under a DDP wrapper (FSDP2 shards in place: the model itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def no_sync(model, last: bool):
    """Reduce gradients over the ranks only after the last micro-batch of a rank's step: DDP's
    ``no_sync`` before it; FSDP2 keeps the unsharded gradients until then."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last)
    elif not last and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return nullcontext()


def eval_model(model):
    """The module validation runs on: the bare model under DDP (its forward would sync buffers
    on every rank); the sharded model itself under FSDP2 (every rank must take part)."""
    return inner(model)


def full_state_dict(model) -> dict | None:
    """The full (unsharded) CPU state dict on rank 0, None elsewhere; a tied parameter appears
    once, under its first name, as ``save_pretrained`` writes it. A collective under FSDP2:
    call it on every rank."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = inner(model).state_dict()
    if not dist.is_main():
        return None
    first: dict[int, str] = {}
    for name, p in inner(model).named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    tied = {name for name, p in inner(model).named_parameters(remove_duplicate=False) if first[id(p)] != name}
    return {k: v for k, v in sd.items() if k not in tied}


@contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' every time it runs without a process group;
    in one process that is exactly the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def agree(error: BaseException | None, what: str = "writing the checkpoint") -> None:
    """Raise on every rank when any rank failed (one collective), so no rank renames or waits
    alone: this rank's own ``error``, else an UnmaskError naming ``what``."""
    failed = dist.all_reduce_sum(torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64))
    if error is not None:
        raise error
    if failed.item() > 0:
        raise UnmaskError(f"another training process failed while {what}; see its error above")


def save_checkpoint(run_dir: Path, step: int, model, opt, trainer_state: dict,
                    save_extras: Callable[[Path, dict], None] | None = None, keep: int = 1) -> Path:
    """Write ``run_dir/checkpoints/step-{step:08d}`` atomically from every rank (see the module
    docstring for the layout). Call on every rank; returns the final path. On any error the
    staging directory is removed and older checkpoints are untouched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = Path(run_dir) / CKPT_DIR / f"step-{step:08d}"
    tmp = Path(dist.broadcast_object(str(staging_dir(final)) if dist.is_main() else None))
    error = None
    try:
        for name, p in inner(model).named_parameters():  # never save (or later publish) diverged weights
            local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()  # an FSDP2 shard
            problem = weight_problem(name, local) if p.requires_grad else None
            if problem is None and not bool(torch.isfinite(local).all()):
                problem = f"parameter {name} is not finite"
            if problem is not None:
                raise diverged(problem, step, run_dir)
        with write_errors(f"checkpoint {final}", "free disk space or pass another --run-dir"):
            model_sd, optim_sd = get_state_dict(model, opt)
            with _quiet_single_process():
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR),
                         no_dist=not dist.active())
            full = full_state_dict(model)
            if dist.is_main():
                save_model(inner(model), tmp, state_dict=full)
                if save_extras is not None:
                    save_extras(tmp, trainer_state)
                torch.save(trainer_state, tmp / STATE_FILE)
    except BaseException as e:  # noqa: BLE001 - re-raised by agree on this rank
        error = e
    try:
        agree(error)
    except BaseException:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_main():
        with write_errors(f"checkpoint {final}", "free disk space or pass another --run-dir"):
            install(tmp, final)
        prune(run_dir, keep)
    dist.barrier()
    return final


def load_checkpoint(ckpt: Path, model, opt) -> None:
    """Load the model and optimizer state of ``ckpt/dcp`` into the (wrapped) ``model`` and
    ``opt``, resharded to this world size. Call on every rank.

    Raises:
        UnmaskError: the checkpoint's keys or shapes do not match the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(ckpt / DCP_DIR), no_dist=not dist.active())
    except Exception as e:  # CheckpointException / RuntimeError: missing keys or size mismatch
        first = str(e).strip().splitlines()[-1].strip()[:200]
        raise UnmaskError(f"checkpoint {ckpt} does not match the model ({first}); resume with the same --base, "
                          "or pass --overwrite") from None
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def has_dcp(ckpt: Path) -> bool:
    return (ckpt / DCP_DIR).is_dir()
