"""ModelBundle: a loaded model with everything a decoder needs to know about it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unmask.errors import UnmaskError

KINDS = ("causal", "sbd", "masked-diffusion", "block-diffusion")
UNMASK_CONFIG = "unmask_config.json"


@dataclass
class ModelBundle:
    """A model, its tokenizer and the facts decoders read (spec/models.md §2.1 adapter contract).

    kind: one of KINDS. mask_token_id: None for plain causal models. logit_shift: 1 when the
    logits at position i-1 score token i (Dream-style diffusion), else 0. block_size: the native
    block of block-diffusion models. stop_token_ids: ids that end generation (EOS, and BOS for
    llama2.c story models whose documents are BOS-delimited).
    """

    model: torch.nn.Module
    tokenizer: object
    kind: str
    name: str
    path: Path | None = None
    bos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    mask_token_id: int | None = None
    logit_shift: int = 0
    block_size: int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def suppress_ids(self) -> tuple[int, ...]:
        """Token ids never to be generated (the mask token; it is a tied output row)."""
        return () if self.mask_token_id is None else (self.mask_token_id,)

    def encode(self, text: str) -> list[int]:
        """Prompt text -> ids, with BOS when the tokenizer adds one."""
        return list(self.tokenizer(text)["input_ids"])

    def decode_continuation(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """The text that ``new_ids`` add after ``prompt_ids`` (tokenizers drop a leading space
        after BOS, so the continuation is the difference of two decodes)."""
        full = self.tokenizer.decode(list(prompt_ids) + list(new_ids), skip_special_tokens=True)
        head = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
        return full[len(head):] if full.startswith(head) else self.tokenizer.decode(new_ids, skip_special_tokens=True)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise UnmaskError(f"unknown dtype {dtype!r}; use float32 or bfloat16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except RuntimeError:  # torch's message lists two dozen backends; ours names the two that work
        raise UnmaskError(f"unknown device {device!r}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnmaskError("CUDA is not available on this machine; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UnmaskError(f"unsupported device {device}; use cpu or cuda")
    return device


def read_unmask_config(path: Path) -> dict:
    f = path / UNMASK_CONFIG
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UnmaskError(f"{f} is not valid JSON ({e}); restore it or re-save the checkpoint") from None


def _stop_ids(model, tokenizer, meta: dict) -> tuple[int, ...]:
    if "stop_token_ids" in meta:
        return tuple(int(i) for i in meta["stop_token_ids"])
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]))


def load_dir(path: Path, *, name: str, kind: str | None = None, device="cpu", dtype="float32",
             mask_token_id: int | None = None, trust_remote_code: bool = False) -> ModelBundle:
    """Load a local Hugging Face directory into a ModelBundle.

    The kind comes from ``kind``, else from ``unmask_config.json`` in the directory, else
    ``causal``. Raises UnmaskError for a directory without config.json, unreadable weights,
    an unknown kind or a kind that needs a mask token the checkpoint does not name.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unmask.compat import quiet_transformers

    if not (path / "config.json").is_file():
        raise UnmaskError(f"{path} is not a Hugging Face model directory (no config.json)")
    meta = read_unmask_config(path)
    kind = kind or meta.get("kind", "causal")
    if kind not in KINDS:
        raise UnmaskError(f"unknown model kind {kind!r}; choose one of: {', '.join(KINDS)}")
    device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnmaskError(f"cannot load the checkpoint in {path}: {first}") from None
    model.to(device).eval()
    mask_id = mask_token_id if mask_token_id is not None else meta.get("mask_token_id")
    if mask_id is None and kind != "causal":
        mask_id = getattr(model.config, "mask_token_id", None) or getattr(tokenizer, "mask_token_id", None)
    if kind != "causal" and mask_id is None:
        raise UnmaskError(f"{path} is a {kind} model but names no mask token; pass --mask-token-id ID")
    bos = getattr(tokenizer, "bos_token_id", None)
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    return ModelBundle(
        model=model, tokenizer=tokenizer, kind=kind, name=name, path=path, bos_token_id=bos,
        stop_token_ids=_stop_ids(model, tokenizer, meta), pad_token_id=int(pad),
        mask_token_id=None if mask_id is None else int(mask_id),
        logit_shift=int(meta.get("logit_shift", 0)), block_size=meta.get("block_size"), meta=meta,
    )
