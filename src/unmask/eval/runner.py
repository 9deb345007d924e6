"""Run a decoder over a task and score it: the engine behind ``unmask eval``, ``sweep`` and
``bench``.

:func:`evaluate` decodes the task's prompts in batches through :func:`unmask.generate` and
returns an :class:`EvalResult`: one row per item and a summary, each with the decode
statistics (NFE, TPF, TPS, seconds; diffusion spec §10), the decoder configuration and the
environment fingerprint (:mod:`unmask.eval.env`). Per item, ``nfe`` and ``tpf`` are the row's
own; ``seconds`` and ``tps`` belong to the batch the row was decoded in. In the summary, NFE
is the mean per row, TPF the pooled tokens / pooled row forwards and TPS the generated
tokens / decode seconds of all batches (prompt encoding, scoring and the warm-up excluded).

For ``stories`` the runner also computes what the scorers need: the judge NLL of every
continuation (default judge: ``stories260K``) and the reference for agreement, the greedy AR
output of the same model with the same budget and stop tokens. When AR cannot decode the
model's kind (masked or block diffusion), the reference is the judge's greedy AR output; the
rows name it in ``agreement_reference``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from unmask.errors import UnmaskError, is_int
from unmask.threads import scoped
from unmask.eval import tasks as T
from unmask.eval.env import fingerprint

Progress = Callable[[int, int, str], None]  # (done, total, stage)
MIN_NEW_TOKENS = 16  # below this, a context-clipped budget is refused rather than used


@dataclass
class EvalResult:
    """Rows (``type: "item"``) and the summary (``type: "summary"``) of one evaluation."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]

    def jsonl(self) -> str:
        """Every item row, then the summary, one JSON object per line."""
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [*self.rows, self.summary])

    def write(self, path: str | os.PathLike) -> None:
        """Write :meth:`jsonl` to ``path`` atomically."""
        from unmask.fileio import atomic_write_text

        atomic_write_text(path, self.jsonl(), output=True)


@dataclass
class References:
    """Memo of expensive per-model work shared across runs (a sweep, the bench): loaded judges
    and AR reference continuations, keyed by model, prompts and budget."""

    judges: dict[str, Any] = field(default_factory=dict)
    continuations: dict[tuple, tuple[str, list[list[int]]]] = field(default_factory=dict)


def _load(model, *, device: str, dtype: str):
    from unmask.models import ModelBundle, load

    return model if isinstance(model, ModelBundle) else load(model, device=device, dtype=dtype)


def _budget(bundle, prompt_ids: list[list[int]], requested: int | None, spec: T.TaskSpec) -> tuple[int, str | None]:
    """The generation budget: ``requested`` (checked by ``generate``), or the task default clipped
    to what the longest prompt leaves of the context window, with a note saying so."""
    ctx, longest = bundle.context_length, max(len(p) for p in prompt_ids)
    if requested is not None:
        if is_int(requested) and longest + requested > ctx:
            lower = f"lower --max-new-tokens to {ctx - longest} or less, " if longest < ctx else ""
            raise UnmaskError(f"the longest {spec.name} prompt is {longest} tokens; with --max-new-tokens "
                              f"{requested} it exceeds {bundle.name}'s {ctx}-token context; {lower}use fewer --shots, "
                              "a smaller --limit or a model with a longer context")
        return requested, None
    budget = min(spec.max_new_tokens, ctx - longest)
    if budget < MIN_NEW_TOKENS:
        if longest > ctx:
            raise UnmaskError(f"the longest {spec.name} prompt is {longest} tokens, {longest - ctx} over "
                              f"{bundle.name}'s {ctx}-token context; use fewer --shots or a model with a longer "
                              "context")
        raise UnmaskError(f"the longest {spec.name} prompt is {longest} tokens and leaves {max(budget, 0)} of "
                          f"{bundle.name}'s {ctx}-token context to generate in; use fewer --shots, a smaller "
                          "--limit or a model with a longer context")
    note = None if budget == spec.max_new_tokens else (
        f"max_new_tokens clipped from {spec.max_new_tokens} to {budget} by the {ctx}-token context")
    return budget, note


def _generate_batches(prompts: list[str], bundle, decoder: str, *, batch_size: int, progress: Progress | None,
                      stage: str, **kwargs) -> list[dict[str, Any]]:
    """Decode ``prompts`` in batches; one dict per prompt with text, tokens and statistics.

    Under torchrun the batches are dealt round-robin to the ranks (data parallel) and gathered
    back in prompt order on every rank; each batch holds the same prompts and starts from the
    same seeded generator as in one process, so the rows are identical to a single-process run
    (timings aside)."""
    from unmask import dist
    from unmask.api import generate

    n_batches = -(-len(prompts) // batch_size)
    tp = bool(bundle.meta.get("tp"))  # tensor-parallel: every rank takes part in every batch
    mine = range(n_batches) if tp else dist.batch_shard(n_batches)
    local: list[tuple[int, dict[str, Any]]] = []
    for done, b in enumerate(mine, start=1):
        s = b * batch_size
        g = generate(prompts[s:s + batch_size], bundle, decoder, **kwargs)
        for i in range(len(g.prompts)):
            row = g.stats.row(i)
            local.append((s + i, {"prompt": g.prompts[i], "text": g.texts[i], "tokens": g.tokens[i], "prompt_tokens": g.prompt_tokens[i],
                                  "n_tokens": row["generated"], "nfe": row["nfe"], "tpf": row["tpf"],
                                  "seconds": g.stats.seconds, "tps": row["generated"] / g.stats.seconds
                                  if g.stats.seconds > 0 else 0.0, "batch_seconds": g.stats.seconds,
                                  "batch_tps": g.stats.tps, "batch": b,
                                  "batch_nfe": g.stats.nfe, "stop_token": row.get("stop_token", 0),
                                  "accept_histogram": row.get("accept_histogram"),
                                  "batch_query_windows": g.stats.extra.get("query_windows")}))
        if progress is not None:  # this rank's share, scaled to the whole run
            progress(min(len(prompts), done * (1 if tp else dist.world()) * batch_size), len(prompts), stage)
    return [row for _, row in local] if tp else dist.gather_ordered(local)


def _judge_ids(judge, items: list[T.Item], gens: list[dict[str, Any]]) -> tuple[list, list]:
    """Prompt and continuation ids as the judge's tokenizer writes them: the generated ids
    themselves when the tokenizers agree on every prompt (all stories260K variants), else the
    texts re-encoded: encode(prompt + text) after encode(prompt) (the text alone if the joint
    encoding does not start with the prompt's)."""
    vocab = judge.model.config.vocab_size
    prompts = [judge.encode(it.prompt) for it in items]
    if all(p == g["prompt_tokens"] and all(t < vocab for t in g["tokens"]) for p, g in zip(prompts, gens)):
        return prompts, [g["tokens"] for g in gens]
    conts = []
    for it, p, g in zip(items, prompts, gens):
        full = judge.encode(it.prompt + g["text"])
        if full[:len(p)] == p:
            conts.append(full[len(p):])
        else:  # the joint encoding merged across the boundary: encode the text alone
            conts.append(list(judge.tokenizer(g["text"], add_special_tokens=False)["input_ids"]))
    return prompts, conts


def _reference(bundle, judge, items: list[T.Item], gens, *, budget: int, batch_size: int,
               refs: References, progress: Progress | None) -> tuple[str | None, list[list[int]] | None]:
    """(label, greedy AR continuations) for agreement; see the module doc for the choice."""
    from unmask.decode import DECODERS

    ar_kinds = DECODERS["ar"].kinds
    source = bundle if bundle.kind in ar_kinds else judge
    same_ids = source is bundle or all(judge.encode(it.prompt) == g["prompt_tokens"] for it, g in zip(items, gens))
    if not same_ids:
        return None, None
    key = (source.name, id(source.model), budget, tuple(it.prompt for it in items))
    if key not in refs.continuations:
        out = _generate_batches([it.prompt for it in items], source, "ar", batch_size=batch_size,
                                progress=progress, stage="AR reference", max_new_tokens=budget)
        refs.continuations[key] = (f"ar@{source.name}", [o["tokens"] for o in out])
    return refs.continuations[key]


@scoped
def evaluate(task: str, model=None, decoder: str | None = None, *, limit: int | None = None,
             batch_size: int = 8, max_new_tokens: int | None = None, shots: int | None = None,
             data_dir: str | os.PathLike | None = None, judge="stories260K", temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = 0, device: str = "cpu",
             dtype: str = "float32", warmup: bool = True, workers: int = 2, timeout_s: float = 10.0,
             progress: Progress | None = None, references: References | None = None,
             chat: bool | None = None, system: str | None = None, reference_nfe: bool = False,
             **decoder_options) -> EvalResult:
    """Evaluate ``decoder`` on ``model`` over ``task`` (``stories``, ``gsm8k``, ``humaneval``, ``mbpp``).

    Args:
        model: a ModelBundle, shipped name or local directory (default: the default model).
        decoder: a name from ``unmask.decode.DECODERS`` (default: the model kind's natural one).
        limit: first N items. batch_size: prompts per decoder call.
        max_new_tokens: generation budget; default the task's (stories 128, others 256),
            clipped to the model's context, which the summary's ``notes`` then says.
        shots: GSM8K k-shot / MBPP 0 or 3 (default: 0 / 3).
        data_dir: folder holding ``gsm8k/``, ``humaneval/``, ``mbpp/`` (see ``find_data_dir``).
        judge: causal model scoring ``stories`` continuations (name, path or bundle).
        temperature, top_k, top_p, seed: sampling (temperature 0 = greedy).
        warmup: decode two tokens of the first prompt before timing (first-call overheads).
        workers, timeout_s: sandbox concurrency and per-program limit for code tasks.
        progress: ``progress(done, total, stage)`` after every batch.
        references: a shared :class:`References` memo (sweeps and the bench pass one).
        chat: ask gsm8k, humaneval and mbpp in chat form (:func:`unmask.eval.tasks.load_items`)
            through the model's chat template; ``None`` (default): when the model has one.
            ``stories`` is always raw. system: a system turn for chat prompts.
        reference_nfe: the dLLM decoders decode whole canvases, as the reference code does
            (:func:`unmask.api.generate`); the AR reference of ``stories`` is unaffected.
        decoder_options: passed to the decoder (``policy``, ``gamma``, ``block_size``, ...).

    Returns:
        :class:`EvalResult`. Raises :class:`UnmaskError` on every user error (missing data,
        unknown task, decoder or option, prompts that do not fit the context).
    """
    from unmask.api import check_options
    from unmask.decode import default_decoder, spec_for

    from unmask import dist

    spec = T.get_task(task)
    device = str(dist.setup(device))  # under torchrun: join the group, this rank's GPU
    if batch_size < 1:
        raise UnmaskError(f"--batch-size must be >= 1, got {batch_size}; pass e.g. --batch-size 8")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:  # before any generation
        raise UnmaskError(f"--workers must be an integer >= 1, got {workers!r}; pass e.g. --workers 2")
    if not timeout_s > 0:
        raise UnmaskError(f"timeout_s must be > 0, got {timeout_s!r}; pass e.g. timeout_s=10")
    items = T.load_items(task, limit=limit, shots=shots, data_dir=data_dir, chat=bool(chat))
    if not items:
        raise UnmaskError(f"task {task!r} has no items to evaluate; check its data file or --limit")
    bundle = _load(model, device=device, dtype=dtype)
    if chat is None:
        from unmask.prompts import has_chat_template

        chat = task != "stories" and has_chat_template(bundle)
        if chat:
            items = T.load_items(task, limit=limit, shots=shots, data_dir=data_dir, chat=True)
    if system is not None and not chat:
        raise UnmaskError(f"--system applies to chat prompts, and {task} is asked raw here; drop --system "
                          "(or add --chat)")
    asked = {"chat": chat, "system": system}
    if reference_nfe:  # only when asked: generate() refuses it for the decoders whose reference stops at EOS
        decoder_run = {"reference_nfe": True}
    else:
        decoder_run = {}
    decoder = decoder or default_decoder(bundle.kind)
    if decoder_options.get("compile") is False:  # an explicit "off" is every decoder's default
        decoder_options = {k: v for k, v in decoder_options.items() if k != "compile"}
    check_options(spec_for(decoder, bundle.kind), decoder_options)
    from unmask.api import prepare_prompts

    prompt_ids = prepare_prompts(bundle, [it.query for it in items], **asked)[1]
    budget, note = _budget(bundle, prompt_ids, max_new_tokens, spec)
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    stop = list(spec.chat_stop if chat and spec.chat_stop is not None else spec.stop) or None
    if warmup:
        from unmask.api import generate

        generate(items[0].query, bundle, decoder, max_new_tokens=2, **asked, **sampling, **decoder_run,
                 **decoder_options)
    gens = _generate_batches([it.query for it in items], bundle, decoder, batch_size=batch_size,
                             progress=progress, stage="decode", max_new_tokens=budget, stop=stop,
                             **asked, **sampling, **decoder_run, **decoder_options)
    refs = references if references is not None else References()
    extra: dict[str, Any] = {}
    if task == "stories":
        judge_name = getattr(judge, "name", None) or str(judge)
        jb = refs.judges.get(judge_name)
        if jb is None:  # the model under test judges itself when named, without a second load
            jb = bundle if judge_name == bundle.name else _load(judge, device=device, dtype=dtype)
            refs.judges[judge_name] = jb
        if progress is not None:
            progress(0, len(items), "judge")
        jp, jc = _judge_ids(jb, items, gens)
        from unmask.eval.quality import reference_nll

        nll = reference_nll(jb, jp, jc, batch_size=batch_size)
        label, ref = _reference(bundle, jb, items, gens, budget=budget, batch_size=batch_size,
                                refs=refs, progress=progress)
        scores = T.score_stories([g["tokens"] for g in gens], nll=nll, reference=ref)
        # in bfloat16 even lossless SBD may part from AR at near-ties (README): say which dtype ran
        extra = {"judge": jb.name, "agreement_reference": label, "agreement_dtype": str(bundle.dtype).removeprefix("torch.")}
    else:
        if progress is not None:
            progress(0, len(items), "score")
        scores = _score_sharded(task, items, [g["text"] for g in gens], workers=workers, timeout_s=timeout_s)
    config = {"task": task, "model": bundle.name, "kind": bundle.kind, "decoder": decoder,
              "options": dict(sorted(decoder_options.items())), "max_new_tokens": budget, "stop": stop,
              "shots": spec.default_shots if shots is None else shots, "batch_size": batch_size,
              **asked, **sampling, **decoder_run, **extra}
    env = fingerprint(device=str(bundle.device), dtype=str(bundle.dtype), batch_size=batch_size)
    rows = []
    for it, g, s in zip(items, gens, scores):
        rows.append({"type": "item", "task": task, "id": it.id, "model": bundle.name, "decoder": decoder,
                     "prompt": g["prompt"], "text": g["text"], "n_tokens": g["n_tokens"], "nfe": g["nfe"],
                     "tpf": g["tpf"], "stop_token": g["stop_token"], "seconds": g["seconds"], "tps": g["tps"],
                     "batch_seconds": g["batch_seconds"], "batch_tps": g["batch_tps"], "batch": g["batch"],
                     **s, "config": config, "env": env})
    metrics = T.summarize(task, scores)
    qname = spec.quality_metrics[0]
    summary = {"type": "summary", "task": task, "model": bundle.name, "decoder": decoder, "n": len(rows),
               **_throughput(gens), **metrics, "quality_metric": qname, "quality_pct": metrics.get(qname),
               "notes": [note] if note else [], "config": config, "env": env}
    return EvalResult(rows, summary)


def _score_sharded(task: str, items: list[T.Item], texts: list[str], **kwargs) -> list[dict[str, Any]]:
    """``T.score_texts`` with the items dealt to the ranks in blocks of 8 under torchrun (running
    programs is the costly part of code tasks); the scores come back in item order everywhere."""
    from unmask import dist

    if not dist.active():
        return T.score_texts(task, items, texts, **kwargs)
    block = 8
    local = []
    for b in dist.batch_shard(-(-len(items) // block)):
        part = slice(b * block, (b + 1) * block)
        local += list(enumerate(T.score_texts(task, items[part], texts[part], **kwargs), start=b * block))
    return dist.gather_ordered(local)


def _throughput(gens: list[dict[str, Any]]) -> dict[str, float]:
    """Summary NFE (mean per row), TPF (pooled; a stop token a row committed counts, as in
    :class:`unmask.decode.engine.stats.DecodeStats`), TPS and seconds (over batches); the pooled
    ``accept_histogram`` where every row has one, with ``queries_per_forward`` (lossless SBD: the mean
    over every batch's verify forwards, else None)."""
    tokens = sum(g["n_tokens"] for g in gens)
    committed = tokens + sum(g.get("stop_token", 0) for g in gens)
    row_nfe = sum(g["nfe"] for g in gens)
    batches = {g["batch"]: (g["seconds"], g["batch_nfe"]) for g in gens}
    seconds = sum(s for s, _ in batches.values())
    out = {"generated": tokens, "nfe": row_nfe / len(gens), "tpf": committed / max(row_nfe, 1),
           "tps": tokens / seconds if seconds > 0 else 0.0, "seconds": seconds,
           "forwards": sum(n for _, n in batches.values())}
    if all(g.get("accept_histogram") is not None for g in gens):  # DecodeStats.row's, where the decoder keeps it
        from unmask.decode.engine.stats import mean_window

        windows: Counter = Counter()
        for w in {g["batch"]: g.get("batch_query_windows") or {} for g in gens}.values():
            windows.update({int(q): n for q, n in w.items()})
        out["queries_per_forward"] = mean_window(windows)
        out["accept_histogram"] = dict(sorted(sum((Counter(g["accept_histogram"]) for g in gens), Counter()).items()))
    return out
