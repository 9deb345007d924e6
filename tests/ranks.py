"""Run a function in N processes joined as a gloo process group, the way torchrun starts them.

Each rank is a forked copy of the test process (modules already imported, so a rank starts in
milliseconds) with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); ``unmask.dist.setup`` then joins the group as it would under torchrun. Used by
tests/test_distributed.py only.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, args, rank: int, world: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        value = fn(*args)
        buf = io.BytesIO()  # tensors by value: torch's queue pickling would share memory with a dead process
        torch.save(value, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((rank, "error", traceback.format_exc()))
    finally:
        from unmask import dist

        dist.teardown()


def run_ranks(fn, *args, world: int = 2, timeout: float = 180.0, start: str = "fork") -> list:
    """``[fn(*args) on rank 0, ..., on rank world-1]``; fn's return values go through torch.save.
    ``start="spawn"`` for CUDA ranks (a forked process cannot use CUDA); fn must then be a
    module-level function of an importable module.

    Raises:
        AssertionError: a rank raised (its traceback is the message) or did not finish in time.
    """
    ctx = mp.get_context(start)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, world, port, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    try:
        for _ in range(world):
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} did not finish in {timeout} s") from None
            assert status == "ok", f"rank {rank} failed:\n{value}"
            got[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]
