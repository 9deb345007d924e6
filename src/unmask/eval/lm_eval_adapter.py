"""lm-evaluation-harness adapter: any unmask decoder as the lm-eval model ``unmask``.

Optional: needs ``pip install lm_eval`` (>= 0.4; it brings ``datasets`` and more, so it is not a
core dependency). Importing this module registers the model; without lm_eval the import raises
:class:`UnmaskError` with the install command.

    import lm_eval
    import unmask.eval.lm_eval_adapter  # registers "unmask"
    lm_eval.simple_evaluate(model="unmask", tasks=["gsm8k"],
                            model_args="model=stories260K-sbd,decoder=sbd,gamma=0.35")

or from the shell, ``python -m unmask.eval.lm_eval_adapter --model unmask --model_args ...``
(lm-eval's own command line, with the model registered first; a plain ``lm_eval`` does not
know the model ``unmask``).

``model_args``: ``model`` (or lm-eval's usual ``pretrained``: a shipped name or local
directory), ``decoder``, ``kind``,
``dtype``, ``batch_size``, ``max_length`` (context override) and any decoder option
(``policy``, ``gamma``, ``block_size``, ...). ``generate_until`` runs
:func:`unmask.generate` on batches of requests that share their generation arguments; a
context longer than the window leaves is cut from the left (by tokens, then decoded back to
text). ``loglikelihood`` and ``loglikelihood_rolling`` are teacher-forced next-token scores,
offered for models whose causal forward is a language model (kinds ``causal`` and ``sbd``).
Decode statistics accumulate in :attr:`UnmaskLM.stats` (NFE, tokens, seconds).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from unmask.errors import UnmaskError

MISSING = "the lm-eval adapter needs lm-evaluation-harness; pip install -e '.[lm-eval]' (or pip install 'lm_eval>=0.4')"
try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # exercised only without the extra
    if __name__ == "__main__":  # python -m unmask.eval.lm_eval_adapter: one line, exit 2, as the CLI does
        import sys

        print(f"error: {MISSING}", file=sys.stderr)
        raise SystemExit(2) from None
    raise UnmaskError(MISSING) from None


def _batch_size(value: Any) -> int:
    if value in (None, "auto") or str(value).startswith("auto"):
        return 8
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise UnmaskError(f"batch_size must be an integer or 'auto', got {value!r}") from None
    if size < 1:
        raise UnmaskError(f"batch_size must be >= 1, got {size}")
    return size


@register_model("unmask")
class UnmaskLM(LM):
    """An unmask model and decoder behind lm-eval's ``LM`` interface (see the module doc)."""

    def __init__(self, pretrained: str | None = None, decoder: str | None = None, kind: str | None = None,
                 device: str | None = None, dtype: str = "float32", batch_size: Any = 1,
                 max_batch_size: Any = None, max_length: int | None = None, model: str | None = None,
                 **decoder_options: Any):
        super().__init__()
        from unmask.models import load

        if model is not None and pretrained is not None and model != pretrained:
            raise UnmaskError(f"model_args name two models (model={model}, pretrained={pretrained}); give one")
        pretrained = pretrained if pretrained is not None else model
        if pretrained is None:
            raise UnmaskError("the unmask lm-eval model needs a model; pass --model_args model=NAME_OR_DIR,decoder=...")

        device = device or "cpu"
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes cuda by default; on a CPU machine run there instead.
            warnings.warn(f"device {device!r} requested but CUDA is not available; using cpu", stacklevel=2)
            device = "cpu"
        self.bundle = load(pretrained, kind=kind, device=device, dtype=dtype)
        self.decoder = decoder
        self.options = decoder_options
        self.batch_size = _batch_size(batch_size)
        self.max_length = int(max_length or self.bundle.context_length)
        self._device = self.bundle.device
        self.stats = {"nfe": 0, "generated": 0, "seconds": 0.0}

    @property
    def tokenizer_name(self) -> str:
        return self.bundle.name

    def _fit(self, context: str, max_new: int) -> str:
        """``context``, cut from the left so that it and ``max_new`` tokens fit the window."""
        ids = self.bundle.encode(context)
        room = self.max_length - max_new
        if len(ids) <= room:
            return context
        if room < 1:
            raise UnmaskError(f"max_gen_toks {max_new} leaves no room for a context in {self.max_length} tokens")
        return self.bundle.tokenizer.decode(ids[-room:], skip_special_tokens=True)

    def generate_until(self, requests) -> list[str]:
        """Greedy (or sampled, when ``do_sample``) continuations cut at the ``until`` strings."""
        from unmask.api import generate

        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            kwargs = req.args[1] if len(req.args) > 1 else {}
            groups.setdefault(repr(sorted(kwargs.items(), key=lambda kv: kv[0])), []).append(i)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1]) if len(requests[indices[0]].args) > 1 else {}
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            for s in range(0, len(indices), self.batch_size):
                chunk = indices[s:s + self.batch_size]
                contexts = [self._fit(requests[i].args[0], max_new) for i in chunk]
                g = generate(contexts, self.bundle, self.decoder, max_new_tokens=max_new, temperature=temperature,
                             stop=until or None, **self.options)
                self.stats["nfe"] += g.stats.nfe
                self.stats["generated"] += g.stats.generated
                self.stats["seconds"] += g.stats.seconds
                for i, text in zip(chunk, g.texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

    def _score(self, context_ids: list[int], target_ids: list[int]) -> tuple[float, bool]:
        from unmask.compat import forward

        if self.bundle.kind not in ("causal", "sbd"):
            raise UnmaskError(f"loglikelihood needs a causal model; {self.bundle.name} is {self.bundle.kind!r}")
        seq = (context_ids + target_ids)[-self.max_length:]
        n = len(target_ids)
        ids = torch.tensor([seq], device=self.bundle.device)  # (1, T)
        pos = torch.arange(len(seq), device=self.bundle.device)[None]  # (1, T)
        with torch.inference_mode():
            logits = forward(self.bundle.model, ids, position_ids=pos)[0, -n - 1:-1]  # (n, V)
        logp = torch.log_softmax(logits, dim=-1)
        tgt = ids[0, -n:]  # (n,)
        return float(logp.gather(-1, tgt[:, None]).sum()), bool((logp.argmax(-1) == tgt).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """log P(continuation | context) and whether greedy decoding would produce it."""
        out = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            ctx_ids = self.bundle.encode(context)
            full = self.bundle.encode(context + continuation)
            target = full[len(ctx_ids):] if full[:len(ctx_ids)] == ctx_ids else \
                list(self.bundle.tokenizer(continuation, add_special_tokens=False)["input_ids"])
            if not target:
                raise UnmaskError("loglikelihood: the continuation encodes to no tokens")
            out.append(self._score(ctx_ids, target))
            self.cache_hook.add_partial("loglikelihood", req.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        """log P(text) from BOS, in one window (texts longer than the window are refused)."""
        out = []
        for req in requests:
            ids = self.bundle.encode(req.args[0])
            if len(ids) > self.max_length:
                raise UnmaskError(f"loglikelihood_rolling: a text of {len(ids)} tokens exceeds the "
                                  f"{self.max_length}-token window")
            out.append(self._score(ids[:1], ids[1:])[0])
        return out


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``unmask`` model registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
