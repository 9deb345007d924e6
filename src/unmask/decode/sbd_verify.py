"""Lossless Set Block Decoding: the block mode drafts, the NTP mode verifies in the same forward
(spec/sbd_exact.md §1–2).

Each forward feeds, per row, the *verify part* ``b, s_1..s_{K-1}`` (the last committed token and
the current draft, causal) and the *draft groups*: all-mask blocks of K tokens placed after draft
prefixes, which see the cache, their prefix of the verify part and themselves, never another
group. The NTP logits of the verify part accept the longest confirmed prefix of the draft plus one
bonus token (greedy: argmax agreement; sampling: the speculative-sampling rule), and the group after
the accepted prefix supplies the next draft. Only causal K/V of committed tokens survive a step, so
the output is exactly what NTP decoding of the same model gives: token for token under greedy
decoding, in distribution under sampling.

Two drafting layouts (spec §1):

- ``quadratic``: K groups, group i after ``b, s_1..s_i``; K + K² query tokens per row. A draft is
  available whatever was accepted.
- ``linear``: one group after the whole verify part (2K query tokens). Its draft is usable only
  when the whole draft was accepted; a row whose draft was rejected places its next group right
  after ``b`` and verifies nothing (it commits one token and gets a fresh draft).

Batching (spec §2): rows accept different lengths. Every row appends its K verify tokens to the
``DynamicCache``; rejected ones stay as invalid keys of that row (``key_valid``), and the tail that
no row accepted is cropped, so a batch of one keeps an exactly compact cache.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from unmask.compat import attention_mask, crop, forward, keep_rows, new_cache
from unmask.decode.batching import left_pad
from unmask.decode.stats import DecodeOutput, DecodeStats
from unmask.errors import UnmaskError
from unmask.masks import as_4d, causal_mask, with_key_padding
from unmask.sampling import Sampling, filter_logits
from unmask.trace import step_event

DRAFTS = ("quadratic", "linear")
# the fastest lossless setting in tokens per second on both shipped SBD models (batch 1, 1 thread,
# benchmarks/sbd_lossless.py): linear drafts cost 2K queries per forward, quadratic ones K + K^2
DEFAULT_DRAFT = "linear"
DEFAULT_BLOCK_SIZE = 8


@dataclass(frozen=True)
class VerifyConfig:
    """Draft block size K (the SBD block size, >= 2) and the drafting layout (spec §1)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    draft: str = DEFAULT_DRAFT

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 2:
            raise UnmaskError(f"lossless SBD needs a block size >= 2 (got {self.block_size!r}); "
                              "pass e.g. --block-size 8")
        if self.draft not in DRAFTS:
            raise UnmaskError(f"unknown draft layout {self.draft!r}; choose one of {', '.join(DRAFTS)}")


@dataclass(frozen=True)
class StepLayout:
    """The fixed query layout of one verify forward, per number of verified tokens.

    For ``L`` = 1..K (the verify prefix a linear group follows; quadratic uses L = K):
    ``mask[L - 1]`` (Q, Q) bool is the attention among the Q new tokens, ``offsets[L - 1]`` (Q,)
    long their positions relative to ``b``. Queries: verify tokens 0..K-1, then groups of K.
    ``groups`` is the number of draft groups (K quadratic, 1 linear).
    """

    mask: torch.Tensor  # (K, Q, Q) bool
    offsets: torch.Tensor  # (K, Q) long
    groups: int
    K: int

    @property
    def queries(self) -> int:
        return self.K + self.groups * self.K


def step_layout(K: int, draft: str, device=None) -> StepLayout:
    """Build the verify-forward layout (spec §1). Pure; exhaustively tested.

    quadratic: group i (i = 0..K-1) is K masks at positions i+1..i+K that see verify tokens 0..i.
    linear: one group at positions L..L+K-1 that sees verify tokens 0..L-1, for each L = 1..K.
    Verify token j sits at position j and sees verify tokens 0..j (causal).
    """
    G = K if draft == "quadratic" else 1
    Q = K + G * K
    masks, offsets = [], []
    q = torch.arange(Q, device=device)
    is_group = q >= K  # (Q,)
    group = torch.where(is_group, (q - K) // K, -1)  # (Q,) group index of each query, -1 for verify
    o = torch.where(is_group, (q - K) % K, 0)  # (Q,) offset inside the group
    for L in range(1, K + 1):
        after = group + 1 if draft == "quadratic" else torch.where(is_group, torch.full_like(q, L), 0)  # (Q,)
        # verify j: causal; group rows: the first `after` verify tokens plus their own group
        sees_verify = torch.where(is_group[:, None], q[None, :K] < after[:, None], q[None, :K] <= q[:, None])  # (Q, K)
        same_group = is_group[:, None] & is_group[None, :] & (group[:, None] == group[None, :])  # (Q, Q)
        m = torch.cat([sees_verify, same_group[:, K:]], dim=1)  # (Q, Q)
        masks.append(m)
        offsets.append(torch.where(is_group, after + o, q))  # (Q,)
    return StepLayout(mask=torch.stack(masks), offsets=torch.stack(offsets), groups=G, K=K)


def prefill_inputs(bundle, prompts: list[list[int]], K: int):
    """The prefill of lossless SBD (spec §1): each left-padded prompt, causal, then one group of
    K masks at the positions after it, which sees the whole prompt and itself.

    Returns inp (B, P+K) long, positions (B, P+K) long, the mask among them (P+K, P+K) bool
    (key padding not yet folded in), kv_valid (B, P+K) bool, valid (B, P) bool and row_len (B,)."""
    device = bundle.device
    ids, valid, pos = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    B, P = ids.shape
    row_len = valid.sum(dim=1)  # (B,)
    group = torch.full((B, K), bundle.mask_token_id, dtype=torch.long, device=device)  # (B, K)
    inp = torch.cat([ids, group], dim=1)  # (B, P+K)
    positions = torch.cat([pos, row_len[:, None] + torch.arange(K, device=device)], dim=1)  # (B, P+K)
    m = causal_mask(P + K, device=device)  # (P+K, P+K)
    m[P:, P:] = True  # the group is bidirectional and sees the whole prompt
    kv_valid = torch.cat([valid, valid.new_ones(B, K)], dim=1)  # (B, P+K)
    return inp, positions, m, kv_valid, valid, row_len


def greedy_accept(target: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor) -> torch.Tensor:
    """Number of accepted draft tokens per row under greedy decoding (spec §1, Accept, greedy).

    target (B, K) long: argmax of the NTP logits at the verify tokens; draft (B, K-1) long;
    draft_len (B,) long: how many draft tokens are real (K-1, or 0 for a row without a draft).
    Returns a (B,) long in 0..draft_len: the committed tokens are ``target[:, :a + 1]``.
    """
    match = (draft == target[:, :-1]).long()  # (B, K-1)
    a = match.cumprod(dim=1).sum(dim=1)  # (B,)
    return torch.minimum(a, draft_len)


def speculative_accept(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor,
                       generator: torch.Generator | list | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling acceptance (spec §1, Accept, sampling; Leviathan et al. 2023, Alg. 1).

    p (B, K, V): filtered NTP probabilities at the verify tokens; q (B, K-1, V): the filtered
    block-mode probabilities the draft was drawn from; draft (B, K-1) long; draft_len (B,) long.
    Draft token j is accepted with probability min(1, p_{j-1}(s_j) / q_j(s_j)); at the first
    rejection the replacement is drawn from normalize(max(0, p_{j-1} - q_j)); after a fully
    accepted draft the bonus is drawn from p_{draft_len}.

    ``generator``: one generator, or one per row (row r then draws with generator r only).

    Returns (a, last): a (B,) accepted draft tokens, last (B,) the token committed after them.
    """
    B, K, V = p.shape
    p_at = p[:, :-1].gather(2, draft[..., None])[..., 0]  # (B, K-1) p_{j-1}(s_j)
    q_at = q.gather(2, draft[..., None])[..., 0]  # (B, K-1) q_j(s_j)
    u = _uniform((B, K - 1), generator, p.device)  # (B, K-1)
    ok = (u * q_at < p_at).long()  # u < p/q without dividing (q_at > 0: s_j was drawn from q_j)
    a = torch.minimum(ok.cumprod(dim=1).sum(dim=1), draft_len)  # (B,)
    residual = (p[:, :-1] - q).clamp(min=0)  # (B, K-1, V)
    dists = torch.cat([residual, p[:, -1:]], dim=1)  # (B, K, V): residual at j, p_{K-1} after all K-1
    rows = torch.arange(B, device=p.device)
    # a row that accepted all its real draft tokens draws its bonus from p_a, not a residual
    final = torch.where((a < draft_len)[:, None], dists[rows, a], p[rows, a])  # (B, V)
    # max(0, p - q) can be all zeros only when p == q, where p itself is the right distribution
    final = torch.where(final.sum(dim=1, keepdim=True) > 0, final, p[rows, a])
    last = _multinomial(final, generator)  # (B,)
    return a, last


def _uniform(shape: tuple[int, int], generator, device) -> torch.Tensor:
    """U[0, 1) of ``shape`` (B, n), row r from generator r when given one per row."""
    if isinstance(generator, (list, tuple)):
        return torch.stack([torch.rand(shape[1], generator=g, device=device) for g in generator])
    return torch.rand(shape, generator=generator, device=device)


def _multinomial(probs: torch.Tensor, generator) -> torch.Tensor:
    """One draw per distribution: probs (B, ..., V) -> (B, ...), row r from generator r when given one per row."""
    if isinstance(generator, (list, tuple)):
        return torch.stack([_multinomial(probs[r], g) for r, g in enumerate(generator)])
    flat = probs.reshape(-1, probs.shape[-1])  # (rows, V)
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def _probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(..., V) logits -> filtered, tempered probabilities (the same transform for p and q)."""
    return torch.softmax(filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p), dim=-1)


def _draw(logits: torch.Tensor, sampling: Sampling, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens (...,) and, when sampling, their distributions (..., V)."""
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    probs = _probs(logits, sampling)
    return _multinomial(probs, generator), probs


@torch.inference_mode()
def decode(bundle, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
           stop_token_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = (), block_size: int = DEFAULT_BLOCK_SIZE,
           draft: str = DEFAULT_DRAFT, on_forward=None, on_step=None, compile: bool = False,
           static: bool = False) -> DecodeOutput:
    """Lossless SBD decoding of a batch (spec/sbd_exact.md §1–2).

    ``compile=True`` takes the fast path (:func:`unmask.decode.static.verify_decode`): a static KV
    cache whose pointer moves instead of cropping, and a ``torch.compile``-d step; same tokens and
    NFE and step events; it takes no ``on_forward`` hook (UnmaskError). ``static=True`` runs the
    same static-cache loop eagerly (tests, debugging).

    prompts: token ids per row (left-padded internally). One forward per step: prefill = prompt
    (causal) + one draft group; then verify part + draft groups. A row stops at a stop token
    (excluded, later tokens of the same step dropped), a stop string (the completing token kept)
    or ``max_new_tokens``, and is then pruned from the batch and the cache. ``on_forward(info)``
    (tests) sees each forward's inputs, logits and the cache after the step's rollback;
    ``on_step(event)`` gets :mod:`unmask.trace` step events (the committed tokens of each row; the
    canvas shows the unverified draft as masks).

    Returns DecodeOutput; stats.extra holds ``accepts`` (tokens committed per row per forward ->
    count), ``accepted_drafts`` (accepted draft tokens per row per verify forward -> count),
    ``draft``, ``block_size`` and ``verify: True``. Greedy output equals ``ar`` decoding of the
    same model token for token; sampled output has its distribution.
    Raises UnmaskError for a model without a mask token or a bad block size / draft layout.
    """
    if bundle.mask_token_id is None:
        raise UnmaskError("lossless SBD needs a model with a mask token (an SBD model, or a base with an "
                          "SBD adapter: --adapter); train one with 'unmask train sbd' or 'unmask train sbd-adapter'")
    cfg = VerifyConfig(block_size=block_size, draft=draft)
    K, model, device, mask_id = cfg.block_size, bundle.model, bundle.device, bundle.mask_token_id
    if 2 * K > bundle.context_length:
        raise UnmaskError(f"block size {K} is too large for the context window of {bundle.context_length}; "
                          "lower --block-size")
    if compile or static:
        if on_forward is not None:
            raise UnmaskError("compile=True / static=True take no on_forward hook (the static cache is not a "
                              "DynamicCache); drop one of them")
        from unmask.decode import static as fast

        return fast.verify_decode(bundle, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                  stop_token_ids=stop_token_ids, stop_strings=stop_strings, block_size=K,
                                  draft=cfg.draft, compile=bool(compile), on_step=on_step)
    t0 = time.perf_counter()
    layout = step_layout(K, cfg.draft, device)
    Q, G = layout.queries, layout.groups
    N = max_new_tokens
    gens = sampling.row_generators(prompts, device)  # one per row (None when greedy): batch-invariant samples
    suppress = list(bundle.suppress_ids)
    stops = torch.tensor(sorted(set(stop_token_ids)) or [-1], device=device)
    no_stops = not stop_token_ids
    ar = torch.arange(K, device=device)  # (K,)

    # ---- prefill: the prompt (causal) and one draft group right after it
    inp, positions, m, kv_valid, valid, row_len = prefill_inputs(bundle, prompts, K)
    B = valid.shape[0]
    m = with_key_padding(as_4d(m, B), kv_valid)  # (B, 1, P+K, P+K)
    cache = new_cache(model)
    logits = forward(model, inp, position_ids=positions, attention_mask=attention_mask(model, m),
                     cache=cache, logits_to_keep=K + 1)  # (B, K+1, V): last prompt token + group
    crop(cache, K)
    key_valid = valid  # (B, cache columns)
    if suppress:
        logits[..., suppress] = float("-inf")
    first, _ = _draw(logits[:, 0], sampling, gens)  # (B,) the first bonus b
    s, q = _draw(logits[:, 2:], sampling, gens)  # (B, K-1) draft from group offsets 1..K-1
    draft_len = torch.full((B,), K - 1, dtype=torch.long, device=device)
    b = first
    p_b = row_len.clone()  # (B,) position of b
    if on_step is not None:
        for r in range(B):
            canvas = torch.cat([b[r: r + 1], torch.full((K - 1,), mask_id, device=device)])
            on_step(step_event(0, r, torch.ones(1, dtype=torch.bool), b[r: r + 1], 0, canvas, mask_id))
    if on_forward is not None:
        on_forward({"step": 0, "inp": inp, "positions": positions, "logits": logits, "cache": cache,
                    "key_valid": key_valid})

    out = torch.full((B, N + K), -1, dtype=torch.long, device=device)  # slack for a full step
    out[:, 0] = b
    n = torch.ones(B, dtype=torch.long, device=device)  # (B,) committed tokens per row
    rows = list(range(B))  # original index of each running row
    tokens: list[list[int]] = [[] for _ in range(B)]
    stopped = [0] * B  # 1 where a row ended on a stop token (counts for TPF, see DecodeStats)
    nfe, nfe_rows = 1, [1] * B
    row_accepts: list[list[int]] = [[1] for _ in range(B)]

    ended = _ended(out[:, :1], torch.ones(B, dtype=torch.bool, device=device), n, N, stops)
    rows, state = _retire(bundle, prompts, rows, (tokens, stopped), N, n, ended, stops, stop_strings, cache,
                          (key_valid, b, s, q, p_b, draft_len, out, n))
    key_valid, b, s, q, p_b, draft_len, out, n = state
    while rows:
        Bn = len(rows)
        if cfg.draft == "linear":
            L = torch.where(draft_len > 0, K - 1, 0)  # (B,) layout index: the group follows K verify tokens, or 1
            lay_m, lay_o = layout.mask[L], layout.offsets[L]  # (B, Q, Q), (B, Q)
        else:
            lay_m, lay_o = layout.mask[K - 1].expand(Bn, Q, Q), layout.offsets[K - 1].expand(Bn, Q)
        draft_in = torch.where(draft_len[:, None] > 0, s, mask_id)  # (B, K-1): no draft -> mask placeholders
        inp = torch.cat([b[:, None], draft_in, torch.full((Bn, G * K), mask_id, dtype=torch.long, device=device)],
                        dim=1)  # (B, Q)
        positions = p_b[:, None] + lay_o  # (B, Q)
        past = key_valid.shape[1]
        m = torch.cat([key_valid[:, None, :].expand(Bn, Q, past), lay_m], dim=2)[:, None]  # (B, 1, Q, past+Q)
        logits = forward(model, inp, position_ids=positions, attention_mask=attention_mask(model, m),
                         cache=cache)  # (B, Q, V)
        nfe += 1
        if suppress:
            logits[..., suppress] = float("-inf")
        if sampling.greedy:
            top = logits.argmax(dim=-1)  # (B, Q): NTP targets at b, s_1..s_{K-1}, then the groups' fills
            target = top[:, :K]  # (B, K)
            a = greedy_accept(target, s, draft_len)  # (B,)
            step_tok = target  # accepted drafts equal their targets: tokens 0..a are s_1..s_a, then the bonus
            last = target.gather(1, a[:, None])[:, 0]  # (B,)
        else:
            verify = logits[:, :K]  # (B, K, V) NTP at b, s_1..s_{K-1}
            a, last = speculative_accept(_probs(verify, sampling), q, s, draft_len, gens and [gens[r] for r in rows])
            # committed this step: s_1..s_a then `last`, i.e. (b-relative) positions 1..a+1
            step_tok = torch.where(ar[None, :] < a[:, None], torch.cat([s, s[:, :1]], dim=1), 0)  # (B, K)
            step_tok = step_tok.scatter(1, a[:, None], last[:, None])  # (B, K): tokens 0..a valid
        out.scatter_(1, n[:, None] + ar, step_tok)  # entries past a are overwritten later
        # the next draft: group a's offsets 1..K-1 (quadratic), or the single group when usable
        g = a if cfg.draft == "quadratic" else torch.zeros_like(a)
        row_idx = torch.arange(Bn, device=device)
        if sampling.greedy:
            s, q = top[:, K:].view(Bn, G, K)[row_idx, g, 1:], None  # (B, K-1)
        else:
            next_logits = logits[:, K:].view(Bn, G, K, -1)[row_idx, g, 1:]  # (B, K-1, V)
            s, q = _draw(next_logits, sampling, gens and [gens[r] for r in rows])
        # quadratic: always usable; linear: usable when the group followed every real verify token
        if cfg.draft == "linear":
            draft_len = torch.where(a == draft_len, K - 1, 0)
        committed = a + 1
        new = ar[None, :] < committed[:, None]  # (B, K) which step tokens are real
        n_before = n
        n = n + committed
        p_b = p_b + committed
        b = last
        ended = n >= N if no_stops else _ended(step_tok, new, n, N, stops)  # (B,)
        host = torch.cat([committed, ended.long()]).tolist()  # the step's one host sync
        done = any(host[Bn:])
        # cache: keep b, s_1..s_a of each row; the groups' K/V and the tail no row accepted go
        unused = K - max(host[:Bn])
        crop(cache, G * K + unused)
        key_valid = torch.cat([key_valid, new[:, : K - unused]], dim=1)  # (B, past + K - unused)
        for i, (r, c) in enumerate(zip(rows, host[:Bn])):
            nfe_rows[r] += 1
            row_accepts[r].append(c)
            if on_step is not None:
                canvas = torch.cat([out[i, : n[i]], torch.full((K - 1,), mask_id, device=device)])
                on_step(step_event(nfe - 1, r, new[i], step_tok[i], int(n_before[i]), canvas, mask_id))
        if on_forward is not None:
            on_forward({"step": nfe - 1, "inp": inp, "positions": positions, "logits": logits, "cache": cache,
                        "key_valid": key_valid, "accepted": a, "rows": list(rows), "committed": n.clone()})
        if stop_strings or done:
            rows, state = _retire(bundle, prompts, rows, (tokens, stopped), N, n, ended, stops, stop_strings, cache,
                                  (key_valid, b, s, q, p_b, draft_len, out, n), n_before=n_before)
            key_valid, b, s, q, p_b, draft_len, out, n = state

    accepts = Counter(c for ra in row_accepts for c in ra)
    drafted = Counter(c - 1 for ra in row_accepts for c in ra[1:])
    extra = {"verify": True, "draft": cfg.draft, "block_size": K, "accepts": dict(sorted(accepts.items())),
             "accepted_drafts": dict(sorted(drafted.items())),
             "row_extra": [{"verify": True, "draft": cfg.draft, "block_size": K, "accepts": ra}
                           for ra in row_accepts]}
    stats = DecodeStats(nfe=nfe, nfe_per_row=nfe_rows, tokens_per_row=[len(t) for t in tokens],
                        seconds=time.perf_counter() - t0, extra=extra, stops_per_row=stopped)
    return DecodeOutput(tokens=tokens, stats=stats)


def _ended(step_tok: torch.Tensor, new: torch.Tensor, n: torch.Tensor, N: int, stops: torch.Tensor) -> torch.Tensor:
    """(B,) rows that committed a stop token this step or reached N tokens."""
    return (torch.isin(step_tok, stops) & new).any(dim=1) | (n >= N)


def _retire(bundle, prompts, rows, outs, N, n, ended, stops, stop_strings, cache, state, n_before=None):
    """Move finished rows' tokens into ``outs`` = (tokens, stopped) and prune them from the batch
    and the cache (``stopped[r]`` = 1 when the row was cut before a stop token).

    ``state`` is the tuple of per-row tensors (``out`` (B, N + K), the committed ids, at index 6). A
    row's output is cut at its first stop token (excluded) or after the token completing a stop
    string, and at N tokens. Returns the running rows and the pruned ``state`` tensors."""
    out = state[6]
    tokens, stopped = outs
    ended = ended.tolist()
    counts = n.tolist()
    stop_set = set(stops.tolist())
    keep = []
    for i, r in enumerate(rows):
        start = 0 if n_before is None else int(n_before[i])
        full = out[i, : counts[i]].tolist()
        row, hit = cut_row(bundle, prompts[r], full, stop_set, stop_strings, start)
        if ended[i] or hit:
            tokens[r] = row[:N]
            stopped[r] = int(not hit and len(row) < min(len(full), N))  # cut before a stop token
        else:
            keep.append(i)
    if len(keep) == len(rows):
        return rows, state
    idx = torch.tensor(keep, dtype=torch.long, device=out.device)
    if keep:
        keep_rows(cache, idx)
    return [rows[i] for i in keep], tuple(None if t is None else t[idx] for t in state)


def cut_row(bundle, prompt, row: list[int], stop_set: set, stop_strings, start: int) -> tuple[list[int], bool]:
    """A row's committed ids cut at its first stop token (excluded) or, without one, after the
    token completing a stop string (searched from token ``start`` on). Returns (ids, whether a
    stop string ended the row)."""
    cut = next((j for j, t in enumerate(row) if t in stop_set), None)
    if cut is not None:
        return row[:cut], False
    hit = _first_stop_string(bundle, prompt, row, start, stop_strings) if stop_strings else None
    return (row, False) if hit is None else (row[:hit], True)


def _first_stop_string(bundle, prompt, row, start, stop_strings):
    """The length of ``row`` up to and including the token that completes a stop string (searched
    from token ``start`` on), or None."""
    for end in range(max(start, 0) + 1, len(row) + 1):
        text = bundle.decode_continuation(prompt, row[:end])
        if any(s in text for s in stop_strings):
            return end
    return None
