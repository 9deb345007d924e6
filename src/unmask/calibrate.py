"""Choose lossless SBD's draft layout per query budget by replay (spec/sbd_exact.md §5.4, issue 26).

Greedy lossless output is the model's greedy AR text whatever the layout, and a group's logits
equal those of a separate all-mask forward after its prefix (spec §1). So one recording —
the greedy AR text of each prompt and the block mode's argmax after every prefix of it, for every
group length — determines every layout's steps without running the decoder: :func:`replay`
applies the acceptance and the next-draft rule of §5.2 to it and predicts each row's forwards
exactly (the same tokens, up to float ties between block-mode candidates); with the block mode's
top candidates also recorded it replays sibling layouts (§5.3, :mod:`unmask.decode.verify.siblings`).
:func:`search` tries every ``(D, S, G)`` within a budget, :func:`search_trees` adds siblings; :func:`calibrate` records, searches and stores the table in
the model's ``decode_defaults`` (``draft="budget"``, ``queries``, ``draft_layouts``).

Recording costs one forward per prompt and group length: the prompt and its continuation
(causal), then one all-mask group per prefix that sees that prefix and itself
(the quadratic layout over the whole text).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from unmask.decode.verify import layout as dl
from unmask.decode.verify import siblings as sl
from unmask.errors import UnmaskError

DEFAULT_MAX_D = 7
DEFAULT_MAX_G = 8


@dataclass(frozen=True)
class Recording:
    """One prompt's replay data: ``prompt_len`` P, ``text`` the greedy AR continuation (N ids, not
    cut at stop tokens), ``drafts[G][t]`` the block mode's argmax (G ids) of an all-mask group of G
    after the prompt and ``text[:t]`` (t = 0..N-1), ``cands[G][t][o]`` the top ``sl.TOPK`` ids of
    that group's offset o, best first (the siblings' candidates, spec §5.3; None: not recorded),
    ``probs[G][t][o]`` the block mode's softmax probability of that argmax (its confidence in the
    draft token, rounded to 4 digits; suppressed ids excluded as for ``drafts``; None: not recorded;
    :func:`replay_policy`)."""

    prompt_len: int
    text: tuple[int, ...]
    drafts: dict
    cands: dict | None = None
    probs: dict | None = None


@torch.inference_mode()
def record(bundle, prompts: list[list[int]], *, max_new_tokens: int, lengths=range(2, DEFAULT_MAX_G + 1)) -> list[Recording]:
    """Greedy AR text of each prompt (``max_new_tokens`` ids, stop tokens not applied: the replay
    applies them) and the block mode's argmax after every prefix for each group length in
    ``lengths`` (spec §5.4), its top ``sl.TOPK`` candidates there (``cands``, spec §5.3) and the
    probability of its argmax (``probs``, :func:`replay_policy`). One forward per prompt and length. Raises UnmaskError for a model
    without a mask token, an empty prompt, or a prompt + ``max_new_tokens`` past the context window
    (generate's check, before any decoding)."""
    from unmask.api import check_fit
    from unmask.compat import attention_mask, forward
    from unmask.decode import DECODERS

    if bundle.mask_token_id is None:
        raise UnmaskError("calibrating draft layouts needs a model with a mask token (an SBD model, or a base "
                          "with --adapter)")
    if any(len(p) == 0 for p in prompts):
        raise UnmaskError("calibration needs non-empty prompts; drop the empty lines of --prompts")
    check_fit(bundle, prompts, max_new_tokens)
    texts = DECODERS["ar"].decode(bundle, prompts, max_new_tokens=max_new_tokens, stop_token_ids=()).tokens
    suppress = list(bundle.suppress_ids)
    out = []
    for prompt, text in zip(prompts, texts):
        P, N = len(prompt), len(text)
        seq = list(prompt) + list(text[:-1])  # (T,) every prefix the replay can need ends inside it
        T = len(seq)
        drafts, cands, probs = {}, {}, {}
        for G in lengths:
            m = torch.arange(P, P + N)  # (N,) prefix length of each group
            Q = T + N * G
            mask = torch.zeros(Q, Q, dtype=torch.bool)  # (Q, Q)
            mask[:T, :T] = torch.ones(T, T, dtype=torch.bool).tril()  # causal text
            grp = torch.arange(N).repeat_interleave(G)  # (N*G,) group of each mask query
            mask[T:, :T] = torch.arange(T)[None, :] < m[grp][:, None]  # a group sees its prefix
            mask[T:, T:] = grp[:, None] == grp[None, :]  # and itself, bidirectionally
            ids = torch.tensor(seq + [bundle.mask_token_id] * (N * G), device=bundle.device)[None]  # (1, Q)
            pos = torch.cat([torch.arange(T), (m[:, None] + torch.arange(G)[None, :]).flatten()])[None]  # (1, Q)
            mask4 = attention_mask(bundle.model, mask[None, None].to(bundle.device))  # (1, 1, Q, Q)
            logits = forward(bundle.model, ids, position_ids=pos.to(bundle.device), attention_mask=mask4)[0, T:]
            if suppress:
                logits[..., suppress] = float("-inf")
            drafts[G] = logits.argmax(dim=-1).view(N, G).tolist()  # (N, G)
            top = logits.topk(min(sl.TOPK, logits.shape[-1]), dim=-1).indices  # (N*G, TOPK)
            cands[G] = top.view(N, G, -1).tolist()  # (N, G, TOPK)
            p1 = logits.float().softmax(dim=-1).amax(dim=-1)  # (N*G,) the argmax's probability
            probs[G] = [[round(x, 4) for x in row] for row in p1.view(N, G).tolist()]  # (N, G)
        out.append(Recording(P, tuple(text), drafts, cands, probs))
    return out


def replay(rec: Recording, layout, *, stop_ids=(), max_new_tokens: int | None = None) -> tuple[int, int]:
    """The greedy lossless decoder's run of ``layout`` (a DraftLayout, a TreeLayout with siblings or
    their text) on one recording (spec §1 accept, §5.3 siblings, §5.2 next draft): returns (tokens
    produced, stop token included as DecodeStats counts it; forwards). Raises UnmaskError when the
    recording lacks a group length the layout uses, or the candidates its siblings need."""
    tree = sl.as_tree(layout)
    lay, g = tree.chain, rec.text
    K = lay.D + 1
    N, end, produced = _span(rec, {K, *lay.lengths, *(s.group for s in tree.siblings if s.group)}, stop_ids,
                             max_new_tokens)
    if tree.siblings and rec.cands is None:
        raise UnmaskError("the recording has no block-mode candidates for siblings; record it with calibrate.record")
    rule = _rule(lay)
    at = [[(r, s.cont, s.group) for r, s in zip(tree.ranks, tree.siblings) if s.offset == j] for j in range(K + 1)]
    c, nfe, d, src = 1, 1, lay.D, (K, 0, 1)  # the prefill: first token and a group of K after the prompt
    while c < N and c <= end:
        G0, t0, f0 = src  # the group, prefix and first offset the draft came from
        draft = rec.drafts[G0][t0][f0: f0 + d]
        a = 0
        while a < d and c + a < N and draft[a] == g[c + a]:
            a += 1
        nxt = rule[d][a][a]
        if a < d and c + a < N:  # s_{a+1} rejected: a sibling at offset a + 1 may be the NTP argmax
            for rank, cont, grp in at[a + 1]:  # in rank order; a continuation stops at the draft's end
                if rec.cands[G0][t0][f0 + a][rank - 1] == g[c + a]:
                    j, m = a + 1, 0
                    while m < min(cont, d - a - 1) and c + j + m < N and draft[j + m] == g[c + j + m]:
                        m += 1
                    a, first = j + m, m + 1  # the path: s_1..s_{j-1}, the sibling, m continuation tokens
                    nxt = (grp, j, first, max(0, min(grp - first, lay.D))) if grp else rule[d][j - 1][a]
                    break
        nfe += 1
        G, e, first, n = nxt
        c_next = c + a + 1
        if c_next < N and c_next <= end and n:
            src = (G, c + e, first)
        d, c = (n if c_next < N else 0), c_next
    return produced, nfe


def replay_policy(rec: Recording, layouts, choose, *, stop_ids=(), max_new_tokens: int | None = None,
                  first: int = 0) -> tuple[int, int, int]:
    """A per-step choice among chain layouts (issue 26 item 4), replayed on one recording as
    :func:`replay` does: ``layouts`` a list of DraftLayouts (or their text), ``choose(conf, d)`` ->
    the index of the layout that runs the next step, from ``conf`` (a tuple: the block mode's
    probability of each of the d available draft tokens, ``rec.probs``; empty without a draft).
    The prefill runs ``layouts[first]`` (its group of D + 1 after the prompt gives the first draft).
    After a step, the next draft comes from §5.2's rule of the layout that ran it (its groups, the
    offsets ``a - i + 1 .. G_i - 1`` of the latest group at a prefix ``i <= a``), cut to the D of
    the layout chosen next (a shorter draft stays shorter). Every forward, the prefill included,
    spends that layout's ``queries`` (the prefill: ``layouts[first]``'s). Returns (tokens produced,
    forwards, query tokens spent); choosing one layout always gives :func:`replay`'s tokens and
    forwards. Raises UnmaskError when the recording lacks a group length or the probabilities."""
    lays = [dl.parse(x) if isinstance(x, str) else x for x in layouts]
    g = rec.text
    N, end, produced = _span(rec, {G for lay in lays for G in (lay.D + 1, *lay.lengths)}, stop_ids, max_new_tokens)
    if rec.probs is None:
        raise UnmaskError("the recording has no block-mode probabilities; record it with calibrate.record")
    rules = [_rule(lay) for lay in lays]
    lay = lays[first]
    c, nfe, spent = 1, 1, lay.queries  # the prefill: first token and a group of K after the prompt
    full, src = lay.D, (lay.D + 1, 0, 1)  # the next draft before any cut, its group, prefix, first offset
    while c < N and c <= end:
        G0, t0, f0 = src
        i = choose(tuple(rec.probs[G0][t0][f0: f0 + full]), full)
        lay = lays[i]
        d = min(full, lay.D)
        draft = rec.drafts[G0][t0][f0: f0 + d]
        a = 0
        while a < d and c + a < N and draft[a] == g[c + a]:
            a += 1
        nfe += 1
        spent += lay.queries
        G, e, f, n = rules[i][d][a][a]
        c_next = c + a + 1
        if c_next < N and c_next <= end and n:
            src = (G, c + e, f)
        full, c = (G - f if n and c_next < N else 0), c_next  # the group's offsets f..G-1; cut next step
    return produced, nfe, spent


def _span(rec: Recording, lengths, stop_ids, max_new_tokens) -> tuple[int, int, int]:
    """(N tokens replayed, index of the first stop token or N, tokens produced with the stop token
    counted) of one recording; raises UnmaskError when it lacks one of the group ``lengths``."""
    for G in sorted(lengths):
        if G not in rec.drafts:
            raise UnmaskError(f"the recording has no groups of {G}; record lengths up to {G} or more")
    N = min(max_new_tokens or len(rec.text), len(rec.text))
    stops = set(stop_ids)
    end = next((i for i, t in enumerate(rec.text[:N]) if t in stops), N)  # first stop token, else N
    return N, end, end + 1 if end < N else N


@functools.lru_cache(maxsize=None)
def _rule(layout: dl.DraftLayout) -> list[list[list]]:
    """``rule[d][p][a]`` = (group length, group prefix, first offset, length) of the next draft after
    accepting a with the path's longest chain prefix p <= a (p = a: the chain; spec §5.2–5.3)."""
    out = []
    for d in range(layout.D + 1):
        prefixes, rows = layout.groups_for(d), []
        for p in range(d + 1):
            row = [None] * p
            for a in range(p, d + 1):
                group, first, n = layout.next_draft(d, a, p)
                row.append((layout.lengths[group], prefixes[group], first, n) if n else (0, 0, 0, 0))
            rows.append(row)
        out.append(rows)
    return out


def predicted_tpf(recs: list[Recording], layout, **kw) -> float:
    """Tokens per forward of ``layout`` (as :func:`replay` takes it) over the recordings
    (DecodeStats.tpf's definition)."""
    runs = [replay(r, layout, **kw) for r in recs]
    return sum(t for t, _ in runs) / max(1, sum(f for _, f in runs))


def layouts(budget: int, *, max_d: int = DEFAULT_MAX_D, max_g: int = DEFAULT_MAX_G):
    """Every layout (D <= max_d, S any non-empty subset of 0..D, one G in 2..max_g) of at most
    ``budget`` query tokens, in a fixed order."""
    for D in range(1, max_d + 1):
        for size in range(1, D + 2):
            for S in itertools.combinations(range(D + 1), size):
                for G in range(2, max_g + 1):
                    if D + 1 + size * G <= budget:
                        yield dl.DraftLayout(D, S, (G,) * size)


def search(recs: list[Recording], budget: int, **kw) -> tuple[dl.DraftLayout, float]:
    """The layout of at most ``budget`` query tokens with the highest replayed TPF (ties: fewer
    queries, then the first found). Raises UnmaskError when none fits (budget < 4)."""
    best, key = None, None
    lim = {k: kw.pop(k) for k in ("max_d", "max_g") if k in kw}
    for lay in layouts(budget, **lim):
        tpf = predicted_tpf(recs, lay, **kw)
        if key is None or (tpf, -lay.queries) > key:
            best, key = lay, (tpf, -lay.queries)
    if best is None:
        raise UnmaskError(f"no draft layout fits {budget} query tokens; give a budget >= 4")
    return best, key[0]


def sibling_sets(max_cont: int = 3, max_group: int = 6):
    """The sibling sets :func:`search_trees` tries (spec §5.3), in a fixed order: none; one at
    offset 1 (continuation <= max_cont, group 0 or 2..max_group); two at offset 1 (the second with
    continuation <= 1 and group <= 4); one at offset 2 (continuation <= 2, group <= 4), alone or
    after one at offset 1."""
    one = [sl.Sibling(1, c, g) for c in range(max_cont + 1) for g in (0, *range(2, max_group + 1))]
    small = [sl.Sibling(1, c, g) for c in range(2) for g in (0, 2, 3, 4)]
    two = [sl.Sibling(2, c, g) for c in range(3) for g in (0, 2, 3, 4)]
    yield ()
    yield from ((s,) for s in one)
    yield from ((s, t) for s in one for t in small)
    yield from ((t,) for t in two)
    yield from ((s, t) for s in one for t in two)


def search_trees(recs: list[Recording], budget: int, *, top: int = 10, sets=None, **kw) -> tuple[sl.TreeLayout, float]:
    """The best chain-plus-siblings layout of at most ``budget`` query tokens (spec §5.3): every
    sibling set of ``sets`` (default :func:`sibling_sets`) on the ``top`` best chains (replayed
    TPF) that fit beside it. Ties: fewer queries, then the first found; ``sets=[()]`` is
    :func:`search`. Raises UnmaskError when no layout fits (budget < 4)."""
    lim = {k: kw.pop(k) for k in ("max_d", "max_g") if k in kw}
    chains = [(predicted_tpf(recs, lay, **kw), lay.queries, i, lay) for i, lay in enumerate(layouts(budget, **lim))]
    if not chains:
        raise UnmaskError(f"no draft layout fits {budget} query tokens; give a budget >= 4")
    chains.sort(key=lambda x: (-x[0], x[1], x[2]))  # best first
    best, key = None, None
    for sibs in (sibling_sets() if sets is None else sets):
        cost = sum(s.queries for s in sibs)
        fits = [(t, lay) for t, _, _, lay in chains
                if lay.queries + cost <= budget and all(s.offset + s.cont <= lay.D for s in sibs)][:top]
        for tpf, lay in fits:
            tree = sl.TreeLayout(lay, tuple(sibs))
            tpf = predicted_tpf(recs, tree, **kw) if sibs else tpf
            if key is None or (tpf, -tree.queries) > key:
                best, key = tree, (tpf, -tree.queries)
    return best, key[0]


def calibrate(bundle, prompts: list[list[int]], *, budgets=dl.BUDGETS, max_new_tokens: int = 128,
              max_d: int = DEFAULT_MAX_D, max_g: int = DEFAULT_MAX_G, siblings: bool = False) -> list[dict]:
    """Record ``prompts`` and search every budget (spec §5.4; ``siblings``: layouts with sibling
    candidates too, :func:`search_trees`, spec §5.3). Returns one row per budget:
    ``{"queries": Q, "layout": "D/S/G", "layout_queries": q, "tpf": predicted}``, plus rows for the
    named layouts linear / quadratic at K = 8 (``"budget": None``) to compare."""
    longest = max(max_g, max_d + 1)
    recs = record(bundle, prompts, max_new_tokens=max_new_tokens, lengths=range(2, longest + 1))
    kw = dict(stop_ids=tuple(bundle.stop_token_ids), max_new_tokens=max_new_tokens, max_d=max_d, max_g=max_g)
    rows = []
    for Q in budgets:
        lay, tpf = (search_trees(recs, Q, sets=list(sibling_sets(max_group=min(6, longest))), **kw) if siblings
                    else search(recs, Q, **kw))
        rows.append({"budget": Q, "layout": lay.spec, "queries": lay.queries, "tpf": tpf})
    del kw["max_d"], kw["max_g"]
    for name, lay in (("linear", dl.linear(8)), ("quadratic", dl.quadratic(8))):
        if max(lay.lengths) <= longest:
            rows.append({"budget": None, "layout": name, "queries": lay.queries, "tpf": predicted_tpf(recs, lay, **kw)})
    return rows


def stored_defaults(defaults: dict, rows: list[dict], queries: int = dl.DEFAULT_BUDGET) -> dict:
    """``decode_defaults`` with the calibrated table: lossless SBD on, ``draft="budget"``,
    ``queries`` and ``draft_layouts`` set; the other keys kept. A budget ``rows`` do not cover keeps
    its stored layout (recalibrating one budget leaves the others)."""
    stored = dl.stored_layouts(defaults) if defaults.get("draft_layouts") is not None else {}
    table = {**stored, **{r["budget"]: r["layout"] for r in rows if r["budget"] is not None}}
    return {**defaults, "verify": True, "draft": "budget", "queries": queries, "draft_layouts": dl.format_layouts(table)}


def measured(rows: list[dict], layout: str, *, prompts: int, max_new_tokens: int, dtype: str) -> dict | None:
    """The ``lossless_measured`` record (:mod:`unmask.decode.choice`) of the default ``layout``
    (``D/S/G`` text) among calibrated ``rows``: its predicted TPF, which equals the decoder's on
    these prompts, and its query tokens per forward; None when no row holds that layout."""
    row = next((r for r in rows if r["budget"] is not None and dl.canonical(r["layout"]) == dl.canonical(layout)), None)
    if row is None:
        return None
    return {"tpf": round(row["tpf"], 3), "queries": row["queries"], "draft": row["layout"], "prompts": prompts,
            "max_new_tokens": max_new_tokens, "dtype": dtype, "source": "unmask calibrate-drafts (greedy replay)"}


def store_measured(config_file, record: dict | None, layout: str) -> None:
    """Write ``record`` as ``lossless_measured`` into ``config_file`` (a model's unmask_config.json or
    an adapter's adapter.json), atomically. Without a ``record`` (the default ``layout`` was not
    recalibrated) a stored record of that same layout stays, and one of another layout is removed."""
    import json
    from pathlib import Path

    from unmask.decode.choice import RECORD_KEY
    from unmask.fileio import atomic_write_json

    cfg = json.loads(Path(config_file).read_text(encoding="utf-8"))
    old = cfg.get(RECORD_KEY)
    if record is None and isinstance(old, dict) and "/" in str(old.get("draft")) and \
            dl.canonical(str(old["draft"])) == dl.canonical(layout):
        return
    cfg.pop(RECORD_KEY, None)
    if record is not None:
        cfg[RECORD_KEY] = record
    atomic_write_json(config_file, cfg)


__all__ = ["Recording", "record", "replay", "replay_policy", "predicted_tpf", "layouts", "search", "sibling_sets", "search_trees", "calibrate",
           "stored_defaults", "measured", "store_measured"]
