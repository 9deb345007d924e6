"""The query window of budgeted layouts with siblings and its greedy tree acceptance
(spec/sbd_exact.md §5.1–5.3). Pure tensor functions; :class:`unmask.decode.verify.batch.Verify` runs them.

A step's window (per row): verify queries ``b, s_1..s_{Kmax-1}`` (0..Kmax-1), the chain's group
slots, then one slot per sibling (:mod:`unmask.decode.verify.siblings`): the sibling, its
continuation, its group. A row's input ids come from its *pool* ``[b, s_1..s_{Kmax-1}, sib_1..sib_H,
M]`` (``tok`` indexes it per query). Every root-to-leaf chain of causal queries is a *path*: path 0
the chain ``b, s_1..s_D``; path h + 1 ``b, s_1..s_{j-1}, sib_h, s_{j+1}..s_{j+c}`` (j its offset, c
its continuation). Greedy (§5.3): each path accepts its longest prefix whose every token is the
NTP argmax of its parent; the longest wins (ties: the lowest path, the chain first), its argmaxes
are the committed tokens, and its window queries are the cache columns kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.decode.verify import chain as ch
from unmask.decode.verify import siblings as sl
from unmask.sampling import multinomial, uniform


@dataclass(frozen=True)
class TreeWindow:
    """Every row's step tables inside one query window of Q queries, indexed [K - 1, d] (draft
    size K, d-token draft) and, for the next draft, [..., path, a] (a accepted on that path)."""

    mask: torch.Tensor  # (Kmax, Kmax, Q, Q) bool: attention among the window's queries
    offsets: torch.Tensor  # (Kmax, Kmax, Q) long: position of each query relative to b
    tok: torch.Tensor  # (Kmax, Kmax, Q) long: pool index of each query's input id
    path: torch.Tensor  # (Kmax, Kmax, P, Kmax) long: window query of node i of path p (P = 1 + H)
    path_len: torch.Tensor  # (Kmax, Kmax, P) long: draft tokens on path p (0: no such path)
    src: torch.Tensor  # (Kmax, Kmax, P, Kmax, W) long: window query of each next-draft token
    length: torch.Tensor  # (Kmax, Kmax, P, Kmax) long: the next draft's length (spec §5.2)
    sib_offset: torch.Tensor  # (Kmax, H) long: sibling slot h's draft offset (1 where K has none)
    sib_rank: torch.Tensor  # (Kmax, H) long: its candidate rank (2, 3)
    trees: tuple[bool, ...] = ()  # [K - 1]: draft size K's layout has siblings (host-side)

    @property
    def H(self) -> int:
        return self.sib_offset.shape[1]


def slots(layouts: list) -> tuple[int, list[int], list[int], int]:
    """The window of these layouts (index K - 1; None: an AR step; DraftLayout or TreeLayout):
    verify query j < Kmax; group slot h at ``Kmax + starts[h]``, sibling slot h at
    ``Kmax + sib_starts[h]``, each as long as the longest h-th group / sibling of any layout.
    Returns (Kmax, starts, sib_starts, Q). Pure."""
    trees = [sl.as_tree(l) for l in layouts if l is not None]
    Kmax, Q = len(layouts), len(layouts)
    starts, sib_starts = [], []
    for h in range(max((len(t.chain.lengths) for t in trees), default=0)):
        starts.append(Q - Kmax)
        Q += max(t.chain.lengths[h] for t in trees if h < len(t.chain.lengths))
    for h in range(max((len(t.siblings) for t in trees), default=0)):
        sib_starts.append(Q - Kmax)
        Q += max(t.siblings[h].queries for t in trees if h < len(t.siblings))
    return Kmax, starts, sib_starts, Q


def table_bytes(layouts: list) -> int:
    """Bytes of :func:`tree_window`'s tables for these layouts (mask Kmax²·Q², src Kmax³·P·W, ...), known
    before building them: a long layout's tables grow as Kmax² Q² and Kmax³ P."""
    Kmax, _, sib_starts, Q = slots(layouts)
    P, W = 1 + len(sib_starts), max(Kmax - 1, 1)
    return Kmax * Kmax * (Q * Q + 16 * Q + 8 * P * (Kmax + 1) + 8 * Kmax * P * (W + 1)) + 16 * Kmax * (P - 1)


def tree_window(layouts: list, device=None) -> TreeWindow:
    """Build the tables of :class:`TreeWindow` (spec §5.1–5.3). Pure; exhaustively tested.

    Verify token j <= d sees verify tokens 0..j at offset j; a chain group after prefix e
    (:meth:`DraftLayout.groups_for`) sees verify tokens 0..e and itself, its offset o at e + 1 + o;
    a sibling at offset j <= d sees verify tokens 0..j-1 and itself at offset j, continuation k its
    path's first j verify tokens, the sibling and continuation 1..k at offset j + k, its group the
    first j verify tokens, the sibling and itself at offsets j + 1 + o. Any other query sees only
    itself at offset 0 with a mask id (never an all-masked query row)."""
    trees = [None if l is None else sl.as_tree(l) for l in layouts]
    Kmax, starts, sib_starts, Q = slots(layouts)
    H, W = len(sib_starts), max(Kmax - 1, 1)
    P, MASK = 1 + H, Kmax + H  # paths; the pool index of the mask id
    group_at = [Kmax + g for g in starts]  # the window query of each chain group's offset 0
    mask = torch.eye(Q, dtype=torch.bool).repeat(Kmax, Kmax, 1, 1)  # (Kmax, Kmax, Q, Q)
    offsets = torch.zeros((Kmax, Kmax, Q), dtype=torch.long)
    tok = torch.full((Kmax, Kmax, Q), MASK, dtype=torch.long)
    tok[:, :, 0] = 0  # query 0 is always b
    path = torch.arange(Kmax).repeat(Kmax, Kmax, P, 1)  # (Kmax, Kmax, P, Kmax)
    path_len = torch.zeros((Kmax, Kmax, P), dtype=torch.long)
    src = torch.zeros((Kmax, Kmax, P, Kmax, W), dtype=torch.long)
    length = torch.zeros((Kmax, Kmax, P, Kmax), dtype=torch.long)
    sib_offset = torch.ones((Kmax, H), dtype=torch.long)
    sib_rank = torch.full((Kmax, H), 2, dtype=torch.long)
    for k, tree in enumerate(trees):
        if tree is None:
            continue
        lay, V = tree.chain, tree.D + 1
        for h, (s, r) in enumerate(zip(tree.siblings, tree.ranks)):
            sib_offset[k, h], sib_rank[k, h] = s.offset, r
        for d in range(V):
            m = mask[k, d]  # (Q, Q) view
            m[:V, :V] = torch.ones(V, V, dtype=torch.bool).tril()  # causal verify part
            offsets[k, d, :V] = torch.arange(V)
            tok[k, d, : d + 1] = torch.arange(d + 1)  # b, s_1..s_d (the rest: masks)
            path_len[k, d, 0] = d
            for g, (e, G) in enumerate(zip(lay.groups_for(d), lay.lengths)):
                at = slice(Kmax + starts[g], Kmax + starts[g] + G)  # the group's queries
                m[at, : e + 1] = True
                m[at, at] = True
                offsets[k, d, at] = e + 1 + torch.arange(G)
            for a in range(d + 1):
                _next(src[k, d, 0, a], length[k, d, 0], a, lay.next_draft(d, a), group_at)
            for h, s in enumerate(tree.siblings):
                if s.offset > d:
                    continue
                j, c, base = s.offset, min(s.cont, d - s.offset), Kmax + sib_starts[h]
                nodes = list(range(j)) + list(range(base, base + c + 1))  # b, s_1..s_{j-1}, sibling, continuation
                for i in range(j, j + c + 1):  # the sibling (i = j) and its continuation
                    m[nodes[i], nodes[: i + 1]] = True
                    offsets[k, d, nodes[i]] = i
                    tok[k, d, nodes[i]] = Kmax + h if i == j else i  # sib_h, then s_{j+1}.. again
                path[k, d, h + 1, : j + c + 1] = torch.tensor(nodes)
                path_len[k, d, h + 1] = j + c
                grp = slice(base + 1 + s.cont, base + 1 + s.cont + s.group)
                if s.group:
                    m[grp, nodes[: j + 1]] = True
                    m[grp, grp] = True
                    offsets[k, d, grp] = j + 1 + torch.arange(s.group)
                # the next draft (spec §5.2): from the sibling's own group, the latest on its path (the rule of a
                # one-group chain at prefix j), else from the latest chain group at a prefix <= j - 1
                own = ch.DraftLayout(tree.D, (j,), (s.group,)) if s.group else None
                for a in range(j, j + c + 1):
                    rule = own.next_draft(d, a) if own else lay.next_draft(d, a, j - 1)
                    _next(src[k, d, h + 1, a], length[k, d, h + 1], a, rule, [grp.start] if own else group_at)
    t = dict(device=device)
    return TreeWindow(mask.to(**t), offsets.to(**t), tok.to(**t), path.to(**t), path_len.to(**t), src.to(**t),
                      length.to(**t), sib_offset.to(**t), sib_rank.to(**t),
                      tuple(t is not None and bool(t.siblings) for t in trees))


def _next(src_row: torch.Tensor, length_row: torch.Tensor, a: int, rule: tuple[int, int, int], starts: list) -> None:
    """Write one next-draft rule (group, first offset, length) into src_row (W,) and length_row[a]."""
    g, first, n = rule
    length_row[a] = n
    if n:
        src_row[:n] = starts[g] + first + torch.arange(n)


def inputs(tw: TreeWindow, K: torch.Tensor, dl: torch.Tensor, b: torch.Tensor, s: torch.Tensor, sib: torch.Tensor,
           mask_id: int) -> torch.Tensor:
    """The step's input ids (R, Q) from each row's pool: b (R,), the draft s (R, Kmax - 1), the sibling
    ids sib (R, >= H) and the mask id, by ``tok[K - 1, dl]`` (K, dl (R,))."""
    M = torch.full_like(b[:, None], mask_id)  # (R, 1)
    pool = torch.cat([b[:, None], s, sib[:, : tw.H], M], dim=1)  # (R, Kmax + H + 1)
    return pool.gather(1, tw.tok[K - 1, dl])  # (R, Q)


def greedy_accept(target: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor) -> torch.Tensor:
    """Number of accepted draft tokens per row under greedy decoding (spec §1, Accept, greedy).

    target (B, K) long: argmax of the NTP logits at the verify tokens; draft (B, K-1) long;
    draft_len (B,) long: how many draft tokens are real (K-1, or 0 for a row without a draft).
    Returns a (B,) long in 0..draft_len: the committed tokens are ``target[:, :a + 1]``.
    """
    match = (draft == target[:, :-1]).long()  # (B, K-1)
    a = match.cumprod(dim=1).sum(dim=1)  # (B,)
    return torch.minimum(a, draft_len)


def tree_accept(top: torch.Tensor, inp: torch.Tensor, tw: TreeWindow, K: torch.Tensor, dl: torch.Tensor):
    """Greedy tree acceptance (spec §5.3): top (R, Q) the NTP argmax of every query, inp (R, Q)
    the input ids, K (R,) draft sizes, dl (R,) draft lengths. Returns a (R,) accepted draft tokens,
    p (R,) the winning path and step_tok (R, Kmax), its argmaxes (the first a + 1 committed).
    Without siblings it is :func:`greedy_accept` on the chain (its few ops: an AR step stays cheap)."""
    if tw.H == 0:
        step_tok = top[:, : tw.path.shape[-1]]  # (R, Kmax): b's target, then the draft's
        a = greedy_accept(step_tok, inp[:, 1: step_tok.shape[1]], dl)
        return a, torch.zeros_like(a), step_tok
    pq = tw.path[K - 1, dl]  # (R, P, Kmax)
    R, P, Km = pq.shape
    node = inp.gather(1, pq.flatten(1)).view(R, P, Km)  # (R, P, Kmax) each path's ids
    target = top.gather(1, pq.flatten(1)).view(R, P, Km)  # (R, P, Kmax) their NTP argmaxes
    a_p = (node[..., 1:] == target[..., :-1]).long().cumprod(dim=-1).sum(dim=-1)  # (R, P)
    a_p = torch.minimum(a_p, tw.path_len[K - 1, dl])
    p = a_p.argmax(dim=1)  # (R,) the first longest: the chain on ties
    rows = torch.arange(R, device=top.device)
    return a_p[rows, p], p, target[rows, p]


def kept_columns(tw: TreeWindow, K: torch.Tensor, dl: torch.Tensor, p: torch.Tensor, committed: torch.Tensor,
                 Q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The window queries whose causal K/V a row keeps (its first ``committed`` path nodes):
    keep (R, Q) bool and last (R,) long, one past the last kept query (0: none)."""
    if tw.H == 0:  # a chain keeps its first `committed` queries
        return torch.arange(Q, device=K.device)[None, :] < committed[:, None], committed
    R = K.shape[0]
    pq = tw.path[K - 1, dl][torch.arange(R, device=K.device), p]  # (R, Kmax)
    new = torch.arange(pq.shape[1], device=K.device)[None, :] < committed[:, None]  # (R, Kmax)
    keep = ((pq[:, :, None] == torch.arange(Q, device=K.device)) & new[:, :, None]).any(dim=1)  # (R, Q)
    last = (keep * torch.arange(1, Q + 1, device=K.device)).amax(dim=1)  # (R,)
    return keep, last


def siblings(logits: torch.Tensor, tw: TreeWindow, K: torch.Tensor, draft_src: torch.Tensor) -> torch.Tensor:
    """The next draft's sibling ids (R, H): slot h's candidate of rank ``sib_rank`` at the query
    that drafts offset ``sib_offset`` (draft_src (R, >= Kmax - 1): the window query of each next-draft
    token; logits (R, Q, V))."""
    R, H, V = logits.shape[0], tw.H, logits.shape[2]
    if H == 0:
        return torch.zeros((R, 0), dtype=torch.long, device=logits.device)
    at = draft_src.gather(1, tw.sib_offset[K - 1] - 1)  # (R, H) window query of each sibling's offset
    cands = logits.gather(1, at[..., None].expand(R, H, V)).topk(sl.TOPK, dim=-1).indices  # (R, H, TOPK)
    return cands.gather(2, tw.sib_rank[K - 1][..., None] - 1)[..., 0]  # (R, H)


def first_siblings(logits: torch.Tensor, tw: TreeWindow, K: int) -> torch.Tensor:
    """The first draft's sibling ids (n, H) from a prefill's logits (n, K + 1, V): draft token i is
    the prefill group's offset i, at logit index i + 1 (spec §1, Prefill)."""
    n = logits.shape[0]
    first = torch.arange(2, K + 1, device=logits.device).repeat(n, 1)  # (n, K-1)
    return siblings(logits, tw, torch.full((n,), K, dtype=torch.long, device=logits.device), first)


def sampled_tree_accept(p: torch.Tensor, q: torch.Tensor, inp: torch.Tensor, tw: TreeWindow, K: int, dl: torch.Tensor,
                        generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-candidate speculative sampling over a sibling tree (spec §5.3; SpecInfer's multi-step
    speculative sampling, Miao et al. 2023, arXiv:2305.09781 §4.2), for rows of draft size K.

    p (n, Q, V): filtered NTP probabilities of every window query; q (n, K-1, V): the proposals of
    draft offsets 1..K-1 (the draft token and every sibling at offset j were drawn i.i.d. from q_j,
    :func:`draw_siblings`; a continuation re-verifies the chain's own s_j ~ q_j); inp (n, Q) the
    input ids; dl (n,) draft lengths; one generator per row (or one). Walking down from b, the
    children of the current node at offset j (on the chain: s_j, then the siblings at j; on a
    sibling's path: its continuation) are tried in path order: child x is accepted with probability
    min(1, r(x) / q_j(x)), r being p at the node, replaced by normalize(max(0, r - q_j)) after each
    rejection. When no child is accepted (or there is none), the committed token is drawn from r and
    the step ends. Each committed token therefore has the NTP distribution of its prefix. Returns a
    (n,) accepted draft tokens, the path taken (n,) and step_tok (n, K), its first a + 1 committed."""
    n, dev, k = p.shape[0], p.device, K - 1
    rows = torch.arange(n, device=dev)
    nodes, plen = tw.path[k, dl], tw.path_len[k, dl]  # (n, P, Kmax), (n, P)
    P = nodes.shape[1]
    branch = torch.cat([tw.sib_offset.new_zeros(1), tw.sib_offset[k]])  # (P,) offset where path h leaves the chain
    ids = inp.gather(1, nodes.flatten(1)).view(n, P, -1)  # (n, P, Kmax) each path's ids
    u = uniform((n, k * P), generator, dev).view(n, k, P)  # (n, K-1, P)
    cur, path, a = (torch.zeros(n, dtype=torch.long, device=dev) for _ in range(3))  # node query, path, accepted
    going = torch.ones(n, dtype=torch.bool, device=dev)
    r = p[:, 0]  # (n, V)
    for j in range(1, K):
        r = torch.where(going[:, None], p[rows, cur], r)
        qj, moved = q[:, j - 1], torch.zeros_like(going)
        for h in range(P):
            child = going & ~moved & (j <= plen[:, h]) & ((path == h) | ((path == 0) & (branch[h] == j)))  # (n,)
            x = ids[:, h, j]  # (n,)
            ok = child & (u[:, j - 1, h] * qj[rows, x] < r[rows, x])  # u < r/q without dividing
            cur, path = torch.where(ok, nodes[:, h, j], cur), torch.where(ok, h, path)
            a, moved = torch.where(ok, j, a), moved | ok
            r = torch.where((child & ~ok)[:, None], residual(r, qj), r)
        going &= moved
    last = multinomial(torch.where(going[:, None], p[rows, cur], r), generator)  # (n,)
    drafted = ids[rows, path, 1:K]  # (n, K-1) the path's draft tokens
    tok = torch.where(torch.arange(K, device=dev)[None, :] < a[:, None], torch.cat([drafted, drafted[:, :1]], 1), 0)
    return a, path, tok.scatter(1, a[:, None], last[:, None])


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, r - q)) per row (n, V); r itself where that is all zeros (only when r == q,
    where a rejection has probability 0)."""
    res = (r - q).clamp(min=0)
    mass = res.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, res / mass.clamp(min=1e-30), r)


def draw_siblings(q: torch.Tensor, tw: TreeWindow, K: int, generator) -> torch.Tensor:
    """Sampled rows' sibling ids (n, H): slot h drawn from q at its offset (q (n, K-1, V): the
    draft's proposals), independently of the draft token there (spec §5.3: candidates i.i.d. from q)."""
    at = tw.sib_offset[K - 1] - 1  # (H,)
    return multinomial(q[:, at], generator)  # (n, H)


__all__ = ["TreeWindow", "slots", "tree_window", "inputs", "greedy_accept", "tree_accept", "kept_columns", "siblings", "first_siblings", "sampled_tree_accept", "residual", "draw_siblings"]
