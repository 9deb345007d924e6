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
cache; rejected ones stay as invalid keys of that row (``key_valid``), and the tail that no row
accepted is cropped, so a batch of one keeps an exactly compact cache. This module holds the pure
step functions (the prefill's inputs, the query window, the accept and commit rules); the running
batch that applies them is :class:`unmask.decode.verify.batch.Verify` (AR is its K = 1 case:
:mod:`unmask.decode.verify.ar`), its configuration :mod:`unmask.decode.verify.config`.
"""

from __future__ import annotations

import torch

from unmask.decode.engine.batching import left_pad
from unmask.decode.verify import tree as tv
from unmask.masks import causal_mask


def settle(a, p, step_tok, tw: tv.TreeWindow, K, dl, n, N, live, stops, b, Q: int):
    """A step's commit after acceptance (spec §1 Accept, §5.2). Pure. a, p (R,) the accepted draft tokens and
    path, step_tok (R, Kmax) its argmaxes (the first a + 1 committed); K, dl, n, N, live, b (R,) the rows' draft
    sizes, draft lengths, committed counts, budgets, liveness and bonus; stops (S,); Q the window. A dead slot
    commits nothing. Returns the next bonus (R,), committed (R,), n (R,), the next draft lengths (R,; AR rows: 0),
    keep (R, Q) bool (the cache columns kept) and what the step reads on the host: ended (R,) bool (a stop token
    committed or N reached), last (R,) one past the last kept window column, step_tok."""
    Kmax = step_tok.shape[1]
    nxt = dl if Kmax == 1 else tw.length[K - 1, dl, p, a]  # next draft lengths (AR rows: 0)
    committed = (a + 1) * live  # (R,)
    new = torch.arange(Kmax, device=a.device)[None, :] < committed[:, None]  # (R, Kmax): step_tok committed
    n = n + committed
    ended = ((torch.isin(step_tok, stops) & new).any(dim=1) | (n >= N)) & live  # (R,)
    keep, last = tv.kept_columns(tw, K, dl, p, committed, Q)
    bonus = step_tok[:, 0] if Kmax == 1 else step_tok.gather(1, a[:, None])[:, 0]  # (R,)
    return torch.where(live, bonus, b), committed, n, nxt, keep, ended, last, step_tok


def greedy_step(logits, inp, tw: tv.TreeWindow, K, dl):
    """A greedy step's acceptance and next draft (spec §1, §5.2-5.3), pure: tree acceptance on the logits (R, Q, V) and input ids inp (R, Q) of rows of draft sizes
    K (R,) and draft lengths dl (R,), steps of Kmax >= 2. Returns a (R,) accepted draft tokens, p (R,)
    the winning path, step_tok (R, Kmax) its argmaxes, the next draft (R, Kmax - 1) and its sibling
    ids (R, H), from the winning path's group."""
    top = logits.argmax(dim=-1)  # (R, Q): NTP targets of every query
    a, p, step_tok = tv.tree_accept(top, inp, tw, K, dl)  # (R,), (R,), (R, Kmax)
    src = tw.src[K - 1, dl, p, a]  # (R, W): the window query of each next-draft token (spec §5.2)
    return a, p, step_tok, top.gather(1, src[:, : step_tok.shape[1] - 1]), tv.siblings(logits, tw, K, src)


def greedy_commit(logits, inp, suppress, tw: tv.TreeWindow, K, dl, n, N, live, stops, b, Q: int):
    """A greedy step's work after its forward, pure (the compiled step runs it as one graph): the
    suppressed ids (n,) at -inf, :func:`greedy_step` (Kmax >= 2), then :func:`settle`. Returns the next
    draft (R, Kmax - 1), its sibling ids (R, H) and settle's outputs."""
    logits = logits if suppress is None else logits.index_fill(-1, suppress, float("-inf"))  # (R, Q, V)
    a, p, step_tok, draft, sib = greedy_step(logits, inp, tw, K, dl)
    return (draft, sib, *settle(a, p, step_tok, tw, K, dl, n, N, live, stops, b, Q))


def window(tw: tv.TreeWindow, K, dl, b, s, sib, p_b, kvb, C, mask_id: int):
    """A step's query window, pure: input ids (R, Q), positions (R, Q) and the bool mask (R, 1, Q, Lb)
    over a static cache of Lb columns (kvb (R, Lb): the rows' valid keys in [0, C), C a 0-dim long:
    the cache length; the window's own Q columns start at C)."""
    m, o = tw.mask[K - 1, dl], tw.offsets[K - 1, dl]  # (R, Q, Q), (R, Q): each row's layout for its draft length
    inp = tv.inputs(tw, K, dl, b, s, sib, mask_id)  # (R, Q)
    R, Q, Lb = m.shape[0], m.shape[1], kvb.shape[1]
    rel = torch.arange(Lb, device=kvb.device) - C  # (Lb,): column index relative to the window
    win = m.gather(2, rel.clamp(0, Q - 1).expand(R, Q, Lb))  # (R, Q, Lb): the window's mask, repeated
    mask = torch.where(rel < 0, kvb[:, None, :], win & (rel < Q))  # (R, Q, Lb)
    return inp, p_b[:, None] + o, mask[:, None]


def whole_step(forward, cache, C, kvb, suppress, tw: tv.TreeWindow, K, dl, b, s, sib, p_b, n, N, live, stops,
               mask_id: int, Q: int):
    """A greedy step as one pure function (the compiled step's one graph): the query window
    (:func:`window`), the forward on ``cache`` and :func:`greedy_commit` (an AR step, Kmax = 1: the
    argmax and :func:`settle`). Returns greedy_commit's outputs."""
    inp, positions, mask = window(tw, K, dl, b, s, sib, p_b, kvb, C, mask_id)
    logits = forward(inp, positions, mask, cache)  # (R, Q, V)
    if tw.mask.shape[0] > 1:
        return greedy_commit(logits, inp, suppress, tw, K, dl, n, N, live, stops, b, Q)
    logits = logits if suppress is None else logits.index_fill(-1, suppress, float("-inf"))  # (R, 1, V)
    zero = torch.zeros_like(b)  # (R,): nothing to accept on an AR step's path 0
    return (s, sib[:, :0], *settle(zero, zero, logits.argmax(dim=-1), tw, K, dl, n, N, live, stops, b, Q))


def prefill_inputs(bundle, prompts: list[list[int]], K: int):
    """The prefill of lossless SBD (spec §1): each left-padded prompt, causal, then one group of
    K masks at the positions after it, which sees the whole prompt and itself.

    Returns inp (B, P+K) long, positions (B, P+K) long, the mask among them (P+K, P+K) bool
    (key padding not yet folded in), kv_valid (B, P+K) bool, valid (B, P) bool and row_len (B,)."""
    device = bundle.device
    ids, valid, pos = left_pad(prompts, bundle.pad_token_id, device)  # (B, P) each
    B, P = ids.shape
    row_len = valid.sum(dim=1)  # (B,)
    group = torch.full((B, K), bundle.mask_token_id or 0, dtype=torch.long, device=device)  # (B, K); K = 0: AR
    inp = torch.cat([ids, group], dim=1)  # (B, P+K)
    positions = torch.cat([pos, row_len[:, None] + torch.arange(K, device=device)], dim=1)  # (B, P+K)
    m = causal_mask(P + K, device=device)  # (P+K, P+K)
    m[P:, P:] = True  # the group is bidirectional and sees the whole prompt
    kv_valid = torch.cat([valid, valid.new_ones(B, K)], dim=1)  # (B, P+K)
    return inp, positions, m, kv_valid, valid, row_len
