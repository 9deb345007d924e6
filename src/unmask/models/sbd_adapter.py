"""Gated SBD adapters: block mode at mask positions only, the base model untouched elsewhere
(spec/sbd_exact.md §3).

Every adapted ``nn.Linear`` (attention q/k/v/o and MLP projections by default) computes

    y = W x + g · ΔW x,    g = 1 on tokens whose input id is the mask token M, 0 elsewhere,

with ``W`` frozen and ``ΔW`` low-rank (``B A``, rank r, LoRA init: B = 0) or full-rank. The gate
comes from ``input_ids`` (a forward pre-hook on the decoder stack stores ``input_ids == M``,
(B, T) bool, where the wrapped layers read it), so tokens that are not M run exactly the base
model's arithmetic: their logits and their K/V are bit-identical to the base model's.

The mask token: if the base names one (an SBD model), it is reused; otherwise a new id
``M = vocab_size`` is added as in spec/sbd.md §2 Option A, *without resizing the base*: the
embedding is wrapped so that M reads a trainable adapter row (initialised to the exact mean of
the base rows) and the LM head is wrapped to append one logit column (the row's dot product
with the hidden state; decoders suppress it through ``bundle.suppress_ids``). The base rows,
the base head and the original logit columns are computed by the unchanged base modules.

Transformers code is never patched: modules are wrapped in place on a loaded model.
Not supported: calls with ``inputs_embeds`` instead of ``input_ids`` (no gate: the base runs),
and activation checkpointing that re-runs a forward during backward (the gate is reset after
each forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from unmask.errors import UnmaskError
from unmask.models.adapter_weights import load_adapter_weights, save_adapter_weights

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Gate:
    """The gate of the forward in flight (None outside a forward): ``mask`` (B, T) bool,
    ``column`` (B, T, 1) bool for the inference path's select, ``any`` (False when no token is a
    mask, so the layers skip the delta; read only where that costs no device sync: a CPU tensor
    outside a trace, else assumed True) and, for the training path, ``rows`` (n,) long, the flat
    indices of the True entries (its ``nonzero`` is read lazily, the one host sync of a training
    forward; None when no token is a mask)."""

    def __init__(self):
        self.mask: torch.Tensor | None = None
        self.column: torch.Tensor | None = None
        self.any = False
        self._rows: torch.Tensor | None = None
        self._rows_read = False

    def set(self, mask: torch.Tensor | None) -> None:
        self.mask, self._rows, self._rows_read = mask, None, False
        self.column = None if mask is None else mask[..., None]
        cheap = mask is not None and mask.device.type == "cpu" and not torch.compiler.is_compiling()
        self.any = mask is not None and (bool(mask.any()) if cheap else True)

    @property
    def rows(self) -> torch.Tensor | None:
        if not self._rows_read and self.mask is not None:
            rows = self.mask.reshape(-1).nonzero().squeeze(1)  # the training forward's one host sync
            self._rows, self._rows_read = (rows if rows.numel() else None), True
        return self._rows


class GatedLinear(nn.Module):
    """``y = base(x) + g · ΔW x`` (sbd_exact.md §3). ``base`` is frozen and left as it was.

    x: (B, T, in) -> y: (B, T, out). Rows where the gate is False are ``base(x)`` exactly: with
    gradients (training) the delta is computed on the gated rows only and written there; without
    (decoding) every row's gated value is computed and selected where the gate is True (a
    full-rank delta as ``(W + ΔW) x``, one GEMM with a cached merged weight). ``rank=None`` = full-rank
    ``ΔW`` (out, in), zero-initialised; else ``lora_A`` (r, in) Kaiming-uniform and ``lora_B``
    (out, r) zeros, so a fresh adapter is the identity.
    """

    def __init__(self, base: nn.Linear, rank: int | None, gate: _Gate, generator: torch.Generator | None = None):
        super().__init__()
        self.base = base
        self._gate = gate
        w = base.weight
        if rank is None:
            self.delta = nn.Parameter(torch.zeros_like(w))  # (out, in)
        else:
            a = torch.empty(rank, w.shape[1], dtype=w.dtype, device=w.device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            self.lora_A = nn.Parameter(a)  # (r, in)
            self.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))  # (out, r)

    def delta_out(self, x: torch.Tensor) -> torch.Tensor:
        """ΔW x for x (n, in) -> (n, out)."""
        if hasattr(self, "delta"):
            return x @ self.delta.t()
        return (x @ self.lora_A.t()) @ self.lora_B.t()

    def merged_weight(self) -> torch.Tensor:
        """``W + ΔW`` (out, in) of a full-rank delta, for the inference path; cached while
        neither tensor changes (their version counters; any forward with gradients drops it),
        recomputed inside a trace and for weights made in inference mode. Edits through
        ``.data`` bypass version counters: call :meth:`SBDAdapter.refresh` after them."""
        return self._inference_weights()[1]

    def _inference_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(W, W + ΔW or None for a low-rank delta, bias) for the decoding path. The cache is a
        plain attribute checked by identity and version counter: on a tiny model the module
        attribute lookups of an uncached check cost more than the layer's GEMM."""
        weight, bias = self.base.weight, self.base.bias
        delta = self.__dict__["_parameters"].get("delta")
        if delta is None:
            return weight, None, bias
        if torch.compiler.is_compiling() or delta.is_inference() or weight.is_inference():
            return weight, weight + delta, bias  # (inference tensors keep no version counter to key a cache)
        stamp = (weight._version, delta._version, weight.data_ptr(), delta.data_ptr())
        cached = self.__dict__.get("_merged_cache")  # (W, ΔW, stamp, W + ΔW)
        if cached is None or cached[0] is not weight or cached[1] is not delta or cached[2] != stamp:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable outside inference mode
                cached = self._merged_cache = (weight, delta, stamp, weight + delta)
        return weight, cached[3], bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        if grad:
            self._merged_cache = None  # a step may follow (a fused optimizer's leaves the version counter as it was)
        gate = self._gate
        if gate.mask is None:
            return self.base(x)  # (B, T, out): the base layer, untouched
        if gate.mask.shape != x.shape[:-1]:
            raise UnmaskError(f"gated adapter: gate {tuple(gate.mask.shape)} does not match the layer input "
                              f"{tuple(x.shape)}; the adapter supports Llama/Qwen2/Qwen3 decoder layers only")
        if not gate.any:
            return self.base(x)
        if not grad:
            # inference: a select between the base's own output and the gated one, no gather, no
            # host sync, static shapes. Ungated rows are the base's ``linear`` bit for bit; a
            # full-rank delta runs as one GEMM with the merged weight (on a tiny model the op count
            # is the cost, so the base layer's module call is skipped too: same op, same operands)
            weight, merged, bias = self._inference_weights()
            if merged is not None and torch.compiler.is_compiling():  # one GEMM of [W; W + ΔW]: the graph
                out = weight.shape[0]  # fuses the select, and on CPU the base's columns come out bit for bit
                both = nn.functional.linear(x, torch.cat([weight, merged]), None if bias is None else bias.repeat(2))
                return torch.where(gate.column, both[..., out:], both[..., :out])  # (B, T, out)
            y = nn.functional.linear(x, weight, bias)  # (B, T, out)
            gated = nn.functional.linear(x, merged, bias) if merged is not None else y + self.delta_out(x)
            return torch.where(gate.column, gated, y)
        y = self.base(x)
        rows = gate.rows
        if rows is None:
            return y
        flat = y.reshape(-1, y.shape[-1])  # (B*T, out), a view of y
        # only gated rows change: y_row + ΔW x_row there, the base's values bit for bit elsewhere
        return flat.index_add(0, rows, self.delta_out(x.reshape(-1, x.shape[-1]).index_select(0, rows))).view_as(y)


class MaskEmbedding(nn.Module):
    """The base input embedding, with the mask token's row read from the adapter (``row``, (d,)).

    ids (B, T) -> (B, T, d). Non-mask ids are looked up in the unchanged base table; a new mask
    id (== the base's row count) never reaches the base table.
    """

    def __init__(self, base: nn.Embedding, mask_id: int, row: torch.Tensor):
        super().__init__()
        self.base = base
        self.mask_id = int(mask_id)
        self.row = nn.Parameter(row.detach().clone())  # (d,)

    @property
    def weight(self) -> torch.Tensor:
        """The base table (V, d): code that reads the vocabulary size sees the base's."""
        return self.base.weight

    @property
    def num_embeddings(self) -> int:
        return self.base.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        is_mask = ids == self.mask_id  # (B, T)
        safe = ids.masked_fill(is_mask, 0) if self.mask_id >= self.base.num_embeddings else ids
        emb = self.base(safe)  # (B, T, d)
        # a select, not an index_put of the mask count: no host sync, so a compiled step has no graph break
        return torch.where(is_mask[..., None], self.row.to(emb.dtype), emb)  # (B, T, d)


class MaskLogitHead(nn.Module):
    """The base LM head plus one column for a mask id added past the vocabulary.

    h (B, T, d) -> logits (B, T, V + 1): columns 0..V-1 are ``base(h)`` exactly; column V is
    ``h · row`` (the mask embedding, as a tied head would give). Decoders suppress column V.
    """

    def __init__(self, base: nn.Linear, row: nn.Parameter):
        super().__init__()
        self.base = base
        self.row = row  # shared with MaskEmbedding.row

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        extra = (h @ self.row.to(h.dtype))[..., None]  # (B, T, 1)
        return torch.cat([self.base(h), extra], dim=-1)  # (B, T, V + 1)


@dataclass
class AdapterSpec:
    """What an adapter is: rank (None = full-rank), target module names, the mask token id, and
    whether that id was added past the base vocabulary (``base_vocab`` rows)."""

    rank: int | None
    mask_token_id: int
    base_vocab: int
    targets: tuple[str, ...] = DEFAULT_TARGETS
    added: bool = field(init=False)

    def __post_init__(self):
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1):
            raise UnmaskError(f"adapter rank must be an integer >= 1 (got {self.rank!r}); pass --rank 16 or --full-rank")
        if not 0 <= self.mask_token_id <= self.base_vocab:
            raise UnmaskError(f"mask token id {self.mask_token_id} is outside the base vocabulary of {self.base_vocab} "
                              "(or the one new id after it); pass a valid mask_token_id")
        self.targets = tuple(self.targets)
        if not self.targets:
            raise UnmaskError("no target modules for the adapter; pass e.g. q_proj,k_proj,v_proj,o_proj")
        self.added = self.mask_token_id == self.base_vocab


class SBDAdapter:
    """A gated adapter attached to a causal LM (see :func:`attach`).

    ``parameters()`` are the trainable tensors; ``state_dict()`` maps their names in the
    adapted model (e.g. ``model.layers.0.self_attn.q_proj.lora_A``, ``model.embed_tokens.row``)
    to tensors. ``save_weights(dir)`` / ``load_weights(dir)`` read and write
    ``adapter.safetensors`` (the training loop's checkpoint hook, unmask.train.checkpoint).
    """

    def __init__(self, model, spec: AdapterSpec, gate: _Gate, handles: list):
        self.model, self.spec, self._gate, self._handles = model, spec, gate, handles

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        own = []
        for name, module in self.model.named_modules():
            if isinstance(module, (GatedLinear, MaskEmbedding)):
                own += [(f"{name}.{leaf}", p) for leaf, p in module.named_parameters(recurse=False)]
        return own

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.named_parameters()}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def load_state_dict(self, state: dict[str, torch.Tensor], where: str = "the adapter file") -> None:
        """Copy ``state`` into the adapter; UnmaskError when names or shapes differ."""
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise UnmaskError(f"{where} does not match this adapter (missing {missing[:2]}, unexpected {unexpected[:2]}); "
                              "it was saved for another model or rank, retrain it or load it on its own base")
        with torch.no_grad():
            for name, p in own.items():
                if tuple(state[name].shape) != tuple(p.shape):
                    raise UnmaskError(f"{where}: {name} has shape {tuple(state[name].shape)}, the model needs "
                                      f"{tuple(p.shape)}; load the adapter on the base it was trained on")
                p.copy_(state[name].to(p.dtype))

    def refresh(self) -> None:
        """Drop every cached merged weight (after edits through ``.data``, which no version
        counter sees); the next decoding forward merges again."""
        for module in self.model.modules():
            if isinstance(module, GatedLinear):
                module._merged_cache = None

    def save_weights(self, directory) -> None:
        save_adapter_weights(self, directory)

    def load_weights(self, directory) -> None:
        load_adapter_weights(self, directory)


def _set_gate(gate: _Gate, mask_id: int):
    def pre(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        gate.set(None if ids is None else ids == mask_id)  # (B, T) bool

    def post(module, args, kwargs, output):
        gate.set(None)

    # what they set depends on the call's tensors alone: a compiled step needs no guard on them
    # beyond dynamo's tensor checks (unmask.decode.engine.static._guard_filter)
    pre.unmask_tensor_only = post.unmask_tensor_only = True
    return pre, post


def linear_names(model) -> list[str]:
    """The names (last path component, e.g. ``q_proj``) of ``model``'s ``nn.Linear`` layers an
    adapter can wrap: every one but the LM head, sorted."""
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not head and name})


def check_targets(model, targets, what: str = "--targets") -> None:
    """Raise UnmaskError, naming the layers ``model`` has, unless ``targets`` is a non-empty
    sequence of names each matching an ``nn.Linear`` of ``model`` (see :func:`linear_names`)."""
    have = linear_names(model)
    names = list(targets) if isinstance(targets, (list, tuple)) else None
    if not names or not all(isinstance(t, str) and t for t in names):
        raise UnmaskError(f"{what} must be layer names, at least one and none empty (got {targets!r}); pass some "
                          f"of the linear layers of {type(model).__name__}: {', '.join(have)}")
    unknown = [t for t in names if t not in have]
    if unknown:
        raise UnmaskError(f"{what}: {type(model).__name__} has no linear layer named {', '.join(map(repr, unknown))}; "
                          f"its layers are: {', '.join(have)}")


def attach(model, spec: AdapterSpec, *, seed: int = 0):
    """Wrap ``model`` (a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``) in
    place with a fresh gated adapter and return the :class:`SBDAdapter`.

    Every base parameter is frozen (``requires_grad=False``); the adapter's are trainable. With
    ``spec.added`` the mask row starts at the exact mean of the base embedding rows; otherwise
    at the base's own mask row; ``lora_A`` is drawn from a generator seeded with ``seed`` (the
    same adapter init every run). The model gets ``unmask_weights_io`` (the adapter) so training
    checkpoints save and load only the adapter. Raises UnmaskError for a model that already
    carries an adapter, one without a decoder stack/embedding, a rank above the hidden size, or
    targets that match nothing.
    """
    if getattr(model, "unmask_weights_io", None) is not None:
        raise UnmaskError("this model already carries an SBD adapter; load the base afresh to attach another")
    stack = getattr(model, "base_model", None)
    embed = model.get_input_embeddings()
    if stack is None or stack is model or not isinstance(embed, nn.Embedding):
        raise UnmaskError(f"{type(model).__name__} is not a decoder-only causal LM with an embedding table; "
                          "gated adapters support Llama, Qwen2 and Qwen3 causal LMs")
    hidden = getattr(model.config, "hidden_size", None)
    if spec.rank is not None and isinstance(hidden, int) and spec.rank > hidden:
        raise UnmaskError(f"adapter rank {spec.rank} exceeds the hidden size {hidden} of {type(model).__name__} (a "
                          "low-rank delta of higher rank has more parameters than a full one and no more expressive "
                          f"power); pass --rank {hidden} or less, or --full-rank")
    check_targets(model, spec.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    gate = _Gate()
    generator = torch.Generator(device=embed.weight.device).manual_seed(seed)
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in spec.targets and module is not model.get_output_embeddings():
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, leaf, GatedLinear(module, spec.rank, gate, generator))
    with torch.no_grad():
        base_rows = embed.weight  # (V, d)
        row = base_rows.mean(dim=0) if spec.added else base_rows[spec.mask_token_id]  # (d,)
    memb = MaskEmbedding(embed, spec.mask_token_id, row)
    model.set_input_embeddings(memb)
    if spec.added:
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise UnmaskError(f"{type(model).__name__} has no linear LM head; gated adapters support Llama/Qwen causal LMs")
        model.set_output_embeddings(MaskLogitHead(head, memb.row))
        model.config.vocab_size = spec.base_vocab + 1  # logits carry the suppressed mask column
    pre, post = _set_gate(gate, spec.mask_token_id)
    handles = [stack.register_forward_pre_hook(pre, with_kwargs=True),
               stack.register_forward_hook(post, with_kwargs=True)]
    adapter = SBDAdapter(model, spec, gate, handles)
    for p in adapter.parameters():
        p.requires_grad_(True)
    model.unmask_weights_io = adapter
    return adapter


def adapter_of(model) -> SBDAdapter | None:
    """The gated adapter attached to ``model``, or None."""
    found = getattr(model, "unmask_weights_io", None)
    return found if isinstance(found, SBDAdapter) else None
