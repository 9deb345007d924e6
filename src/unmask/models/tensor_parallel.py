"""Tensor-parallel loading (``--tp N``) through transformers' distributed loading.

unmask does not shard weights itself: ``from_pretrained(..., distributed_config=
DistributedConfig(tp_plan="auto"))`` applies the model class's own plan (for Llama/Qwen:
q/k/v/gate/up column-wise, o/down row-wise with an all-reduce, the LM head column-wise with its
output gathered). Every rank therefore ends each forward with the same full logits, and the
decoders, whose commit rules are pure functions of those logits and of a generator seeded the
same way on every rank, take the same decisions on every rank with no extra communication.
"""

from __future__ import annotations

import os

import torch

from unmask import dist
from unmask.errors import UnmaskError


def check_tp(tp, world: int, hf_config: dict) -> None:
    """Refuse a ``tp`` that cannot work, before any weight is read.

    Args:
        tp: the requested tensor-parallel degree. world: WORLD_SIZE of this launch.
        hf_config: the directory's config.json as a dict.

    Raises:
        UnmaskError: tp not an integer >= 1, tp different from the torchrun world size, or heads,
            key/value heads or the MLP width that do not split evenly over tp.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise UnmaskError(f"--tp must be an integer >= 1, got {tp!r}; pass e.g. --tp 2")
    if world != tp:
        raise UnmaskError(f"--tp {tp} needs exactly {tp} processes started by torchrun, this launch has {world}; run "
                          f"'torchrun --nproc-per-node {tp} -m unmask ...' (tensor x data parallel is not supported)")
    sizes = {"attention heads": hf_config.get("num_attention_heads"),
             "key/value heads": hf_config.get("num_key_value_heads", hf_config.get("num_attention_heads")),
             "MLP width": hf_config.get("intermediate_size")}
    for what, n in sizes.items():
        if isinstance(n, int) and n % tp:
            raise UnmaskError(f"the model's {n} {what} do not split evenly over --tp {tp}; pass a --tp that divides "
                              f"{n}")


def tp_load_options(tp: int, device: torch.device, hf_config: dict, trust_remote_code: bool
                    ) -> tuple[torch.device, dict]:
    """(this rank's device, extra ``from_pretrained`` keyword arguments) for ``--tp tp``.

    Joins torchrun's process group (gloo on CPU, NCCL on CUDA) so transformers reuses it.

    Raises:
        UnmaskError: see :func:`check_tp`; a model with its own code (no tensor-parallel plan).
    """
    from unmask.compat import tensor_parallel_kwargs

    check_tp(tp, int(os.environ.get("WORLD_SIZE", "1")), hf_config)
    if trust_remote_code and hf_config.get("auto_map"):
        raise UnmaskError("--tp needs a transformers model class with a tensor-parallel plan; checkpoints with "
                          "their own model code (LLaDA, Dream) have none, so drop --tp")
    device = dist.setup(device)
    return device, tensor_parallel_kwargs(tp)
