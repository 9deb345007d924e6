"""torch.distributed plumbing shared by training, evaluation and generation under ``torchrun``.

unmask never launches processes itself: ``torchrun --nproc-per-node N unmask ...`` (or
``--nnodes``/``--rdzv-*`` for several machines) starts N copies of the same command and sets
``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` and the rendezvous address. :func:`setup` joins the
process group those variables describe (NCCL on CUDA, gloo on CPU) and picks this process's
device; everything else here is a small helper over ``torch.distributed`` that degrades to a
no-op in a plain single process:

- :func:`is_main` / :func:`env_rank`: progress, logs and published files come from rank 0;
- :func:`batch_shard`: which batches (units of work) this rank owns, round-robin, so every
  batch is decoded with exactly the prompts (and the seeded generator) it has in one process;
- :func:`gather_ordered` / :func:`map_batches`: every rank's results back in the original
  order, on every rank;
- :func:`all_reduce_sum`: one collective per training step that carries the stop flags and the
  logged loss sums.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from unmask.devices import resolve_device
from unmask.errors import UnmaskError


def launched() -> bool:
    """True when this process was started by torchrun (or another launcher) with WORLD_SIZE > 1."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def env_rank() -> int:
    """This process's global rank as torchrun announces it (0 outside torchrun); usable before
    :func:`setup`, e.g. to let rank 0 alone clear an output directory."""
    return int(os.environ.get("RANK", "0"))


def active() -> bool:
    """True when a process group with more than one rank is initialised."""
    import torch.distributed as tdist

    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def rank() -> int:
    import torch.distributed as tdist

    return tdist.get_rank() if active() else 0


def world() -> int:
    import torch.distributed as tdist

    return tdist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def setup(device: str | torch.device = "cpu") -> torch.device:
    """Join torchrun's process group (once) and return this process's device.

    Under torchrun with ``device`` ``cuda``: NCCL, device ``cuda:LOCAL_RANK``. With ``cpu``:
    gloo, device ``cpu``. Outside torchrun ``device`` is returned unchanged and nothing else
    happens, so every entry point can call this unconditionally.

    Raises:
        UnmaskError: an unknown device, ``cuda`` without CUDA, or ``cuda`` under torchrun without
            enough visible GPUs for LOCAL_RANK.
    """
    device = resolve_device(device)  # an unknown device, or cuda without CUDA: one line, not a traceback
    if not launched():
        return device
    import torch.distributed as tdist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise UnmaskError(f"LOCAL_RANK {local} has no CUDA device ({torch.cuda.device_count()} visible); "
                              "pass --nproc-per-node at most the number of GPUs, or --device cpu")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        tdist.init_process_group(backend=backend, **kwargs)
    return device


def teardown() -> None:
    """Leave the process group (end of a command); a no-op when none is initialised."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def barrier() -> None:
    if active():
        import torch.distributed as tdist

        tdist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (pickled; for small objects such as a path)."""
    if not active():
        return obj
    import torch.distributed as tdist

    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def batch_shard(n_batches: int, of_rank: int | None = None, world_size: int | None = None) -> list[int]:
    """Batch indices owned by a rank: ``b`` with ``b % world == rank`` (round-robin keeps the
    ranks within one batch of each other). Pure: defaults to this process's rank and world."""
    r = rank() if of_rank is None else of_rank
    w = world() if world_size is None else world_size
    return list(range(r, n_batches, w))


def gather_ordered(local: Sequence[tuple[int, Any]]) -> list[Any]:
    """Gather ``(index, value)`` pairs from every rank and return the values sorted by index,
    on every rank. With one process: the values of ``local`` sorted by index."""
    pairs = list(local)
    if active():
        import torch.distributed as tdist

        everyone: list[Any] = [None] * tdist.get_world_size()
        tdist.all_gather_object(everyone, pairs)
        pairs = [p for part in everyone for p in part]
    return [v for _, v in sorted(pairs, key=lambda p: p[0])]


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Elementwise sum over ranks of a small CPU float64 tensor (one collective); a copy on one
    process. Moved to the NCCL device and back when the backend needs it."""
    if not active():
        return values.clone()
    import torch.distributed as tdist

    dev = torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")
    t = values.to(dev, copy=True)
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t.cpu()


def map_batches(fn, items: Sequence[Any], batch_size: int) -> list[Any]:
    """``[fn(items[0:b]), fn(items[b:2b]), ...]`` with the batches dealt round-robin to the ranks
    (:func:`batch_shard`) and the results gathered in batch order on every rank. Each batch is
    exactly the one a single process would form, so a ``fn`` that depends only on its batch
    gives single-process results."""
    n_batches = -(-len(items) // batch_size)
    return gather_ordered([(b, fn(items[b * batch_size:(b + 1) * batch_size])) for b in batch_shard(n_batches)])
