"""Memory a command's batch size will need, checked against the machine when the command starts, so
a batch that cannot fit is refused with its numbers instead of dying in the allocator (or, in the
server, answering 500 to every request that meets the batch).

The figures are lower bounds (what the batch surely holds), so a refused batch never fits; one that
passes can still run out of memory at run time (activations, fragmentation).
"""

from __future__ import annotations

import os

from unmask.errors import UnmaskError


def free_bytes(device) -> int | None:
    """Bytes free for new tensors on ``device`` (a ``torch.device`` or its name): on CUDA the
    device's free memory plus what PyTorch's allocator holds unused; on CPU the kernel's
    ``MemAvailable`` (``/proc/meminfo``), else ``os.sysconf``'s free pages. None when unknown."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def check(rows: int, per_row: int, device, *, what: str, flag: str, fix) -> None:
    """Raise UnmaskError when ``rows`` x ``per_row`` bytes pass what is free on ``device``.

    what: what one row is (``"a row's 512-token KV cache"``); flag: the option that set ``rows``
    (``--max-batch-size``); fix(fit): what to do, given the most rows the free memory could hold."""
    free = free_bytes(device)
    need = rows * per_row
    if free is None or need <= free:
        return
    where = "on this machine" if str(device) == "cpu" else f"on {device}"
    raise UnmaskError(f"{flag} {rows} needs at least {gib(need)} ({rows} x {what}, {gib(per_row)} each), more "
                      f"than the {gib(free)} free {where}; {fix(free // max(per_row, 1))}")


def dtype_bytes(model) -> int:
    return next(iter(model.parameters())).element_size()


def kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take in the KV cache of ``model`` (all layers), from its config."""
    cfg = model.config
    layers = int(getattr(cfg, "num_hidden_layers", None) or 1)
    heads = int(getattr(cfg, "num_attention_heads", None) or 1)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(getattr(cfg, "hidden_size", heads)) // heads)
    return 2 * layers * kv_heads * head_dim * dtype_bytes(model)


def train_bytes_per_sequence(model, seq_len: int) -> int:
    """A lower bound on the bytes one training sequence of ``seq_len`` tokens holds during a step: its
    float32 logits and their gradient (V each per token) and, per layer, the activations kept for the
    backward pass that no attention kernel avoids (queries, keys, values, the attention output and two
    MLP projections). Attention scores and the objective's extra tokens are not counted: a real step
    takes several times more."""
    cfg = model.config
    emb = model.get_input_embeddings().weight  # (V, d)
    vocab = int(getattr(cfg, "vocab_size", None) or emb.shape[0])
    layers = int(getattr(cfg, "num_hidden_layers", None) or 1)
    hidden = int(getattr(cfg, "hidden_size", None) or emb.shape[1])
    inner = int(getattr(cfg, "intermediate_size", None) or hidden)
    return seq_len * (2 * vocab * 4 + layers * (4 * hidden + 2 * inner) * dtype_bytes(model))
