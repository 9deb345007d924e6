"""Lossless SBD under sampling (spec/sbd_exact.md §1 Accept, sampling; §5.3 for sibling trees): the
first draws of a prefill, speculative-sampling acceptance of a chain and the per-group accept-and-
redraft of a step. Every committed token has the NTP distribution of its prefix, so sampled output
is distributed as AR sampling. :class:`unmask.decode.verify.batch.Verify` runs these for its sampled rows.
"""

from __future__ import annotations

import torch

from unmask.decode.verify import steps as sv
from unmask.decode.verify import tree as tv
from unmask.decode.engine.running import group_by
from unmask.sampling import Sampling, draw as _draw, multinomial as _multinomial, probs as _probs, sample, uniform as _uniform


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


def prefill_draws(logits: torch.Tensor, K: int, groups: dict, tw: tv.TreeWindow) -> tuple:
    """The first bonus (n,), draft (n, K-1) with its proposals (n, K-1, V) (None: all greedy) and
    sibling ids (n, H) from a prefill's logits (n, K+1, V) (the last prompt token, then the group;
    spec §1, Prefill; siblings §5.3: greedy rows the ranked candidates, sampled rows i.i.d. draws
    from q). groups: {sampling: (row indices, their generators)}; K = 1 draws AR's token with ``sample``."""
    b, s, q = logits[:, 0].argmax(dim=-1), logits[:, 2:].argmax(dim=-1), None  # (n,), (n, K-1)
    sib = tv.first_siblings(logits, tw, K) if K > 1 else None  # (n, H)
    for sampling, (at, gens) in groups.items():
        if sampling.greedy:
            continue
        idx = torch.tensor(at, dtype=torch.long, device=logits.device)
        if K == 1:
            b[idx] = sample(logits[idx, 0], sampling, gens)
            continue
        b[idx], _ = _draw(logits[idx, 0], sampling, gens)
        s[idx], qi = _draw(logits[idx, 2:], sampling, gens)
        q = qi.new_zeros((logits.shape[0], *qi.shape[1:])) if q is None else q  # (n, K-1, V)
        q[idx] = qi
        if tw.trees[K - 1]:
            sib[idx] = tv.draw_siblings(qi, tw, K, gens)
    return b, s, q, sib


def accept_sampled(logits: torch.Tensor, q, s: torch.Tensor, inp: torch.Tensor, draft_len: torch.Tensor, K: int,
                   tw: tv.TreeWindow, sampling: Sampling, gens, redraw: bool = True) -> tuple:
    """Accept and redraft rows of one sampling setting and draft size K inside a step's query window
    ``tw`` (spec §1, Accept, sampling; with siblings at K, §5.3's multi-candidate rule,
    :func:`~unmask.decode.verify.tree.sampled_tree_accept`): logits (n, Q, V), q (n, K-1, V) the
    draft's proposals, s (n, K-1) the draft, inp (n, Q) the input ids, draft_len (n,), one generator
    per row. K = 1 draws AR's token with :func:`unmask.sampling.sample`.
    Returns a (n,), the path taken (n,), step_tok (n, K) (the first a + 1 committed), the next
    draft (n, K-1), its proposals (n, K-1, V) and its sibling ids (n, H) (None where K has none;
    past the next draft's length they are unused; all three None without ``redraw``: a layout with
    no mask group, whose next draft comes from the host)."""
    zero = torch.zeros(len(gens), dtype=torch.long, device=logits.device)
    if K == 1:
        return zero, zero, sample(logits[:, :1], sampling, gens), None, None, None
    tree = tw.trees[K - 1]
    if tree:
        a, path, tok = tv.sampled_tree_accept(_probs(logits, sampling), q, inp, tw, K, draft_len, gens)
    else:
        (a, last), path = speculative_accept(_probs(logits[:, :K], sampling), q, s, draft_len, gens), zero
        tok = torch.where(torch.arange(K, device=a.device)[None, :] < a[:, None], torch.cat([s, s[:, :1]], dim=1), 0)
        tok = tok.scatter(1, a[:, None], last[:, None])  # (n, K)
    if not redraw:
        return a, path, tok, None, None, None
    at = tw.src[K - 1, draft_len, path, a][:, : K - 1, None]  # (n, K-1, 1) window query of each next-draft token (§5.2)
    s_next, q_next = _draw(logits.gather(1, at.expand(-1, -1, logits.shape[2])), sampling, gens)  # (n, K-1), (n, K-1, V)
    return a, path, tok, s_next, q_next, tv.draw_siblings(q_next, tw, K, gens) if tree else None


def accept_rows(batch, logits: torch.Tensor, inp: torch.Tensor, tw: tv.TreeWindow, R: int, Kmax: int, s: torch.Tensor,
                dl: torch.Tensor):
    """Accept and redraft every slot of a :class:`~unmask.decode.verify.batch.Verify` step from its logits (R, Q, V)
    (spec §1, §5.3; suppressed ids set to -inf in place):
    greedy tree acceptance for all, then each sampled group (same sampling and K) by speculative sampling.
    Returns a, path p (R,), step_tok (R, Kmax)."""
    if batch.suppress is not None:
        logits[..., batch.suppress] = float("-inf")
    batch.shaping.apply(logits)  # raw logits kept for logprobs; logit_bias, the grammar's masks
    if Kmax == 1:  # AR rows: nothing to accept or draft, the bonus is the argmax
        a, p, step_tok = batch._zero[:R], batch._zero[:R], logits.argmax(dim=-1)  # (R,), (R,), (R, 1)
    else:  # greedy acceptance and the next draft (R, Kmax-1) and siblings (R, H) for all
        a, p, step_tok, batch.s[:R, : Kmax - 1], batch.sib[:R, : tw.H] = sv.greedy_step(logits, inp, tw, batch.K[:R], dl)
    if not batch.n_sampled:
        return a, p, step_tok
    sampled = {k: v for k, v in group_by(batch.rows.items(), lambda r: (r.job.sampling, r.K)).items()
               if not k[0].greedy}
    a, p, step_tok = a.clone(), p.clone(), step_tok.clone()
    for (sampling, K), slots in sampled.items():
        idx = torch.tensor(slots, dtype=torch.long, device=batch.device)  # (n,)
        q = None if K == 1 else batch.q[idx, : K - 1]
        a[idx], p[idx], step_tok[idx, :K], s_i, q_i, sib = accept_sampled(
            logits[idx], q, s[idx, : K - 1], inp[idx], dl[idx], K, tw, sampling, [batch.rows[i].generator for i in slots],
            redraw=not batch.cfg.host)
        if s_i is not None:
            batch.s[idx, : K - 1], batch.q[idx, : K - 1] = s_i, q_i
        if sib is not None:  # siblings drawn i.i.d. from q, as the multi-candidate rule needs (spec §5.3)
            batch.sib[idx, : tw.H] = sib
    return a, p, step_tok


__all__ = ["speculative_accept", "prefill_draws", "accept_sampled", "accept_rows"]

