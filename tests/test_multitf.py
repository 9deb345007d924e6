"""MultiTF (spec/multiblock.md §4): group-aware mask rules, layouts, chain-uniform scheduler, objective, training."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from conftest import SMALL_RUN, descend, ids_file, run_cli, tiny_llama, with_mask_row
from unmask.errors import UnmaskError
from unmask.masks import bd_training_mask, block_causal_mask
from unmask.masks_multitf import group_dual_stream_mask, group_starts
from unmask.train.block_diffusion import IGNORE, masked_ce_loss
from unmask.train.multitf import (PRESETS, ChainUniform, MultiTFObjective, chain_uniform_ratios, group_ids,
                                  random_layout, systematic_layouts)

VOCAB, MASK = 64, 64


def _compositions(K: int):
    """Every way to cut K blocks into runs: group sizes."""
    for cuts in itertools.product([0, 1], repeat=K - 1):
        sizes, run = [], 1
        for c in cuts:
            if c:
                sizes.append(run)
                run = 1
            else:
                run += 1
        yield sizes + [run]


def _rules(groups: list[int], B: int, L: int, aware: list[bool]) -> torch.Tensor:
    """The §4.3 table in plain Python, with the code's g(i) > g(j) form of M_GOC."""
    out = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    for q in range(2 * L):
        for k in range(2 * L):
            qn, kn = q < L, k < L
            bi, bj = (q % L) // B, (k % L) // B
            gi, gj = groups[bi], groups[bj]
            if qn and kn:
                vis = (gi == gj and bj <= bi) if aware[bi] else bj == bi
            elif qn:
                vis = gj < gi if aware[bi] else bj < bi
            elif not kn:
                vis = bj <= bi
            else:
                vis = False
            out[q, k] = vis
    return out


# ---------------------------------------------------------------------------------------------
# The group-aware dual-stream mask (§4.3)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K,B,short", [(1, 2, 0), (2, 1, 0), (3, 2, 0), (4, 2, 1), (4, 3, 2), (5, 1, 0)])
def test_mask_matches_the_rules_for_every_layout(K, B, short):
    L = K * B - short
    for sizes in _compositions(K):
        groups = group_ids(sizes).tolist()
        flags = itertools.product([True, False], repeat=K) if K <= 3 else [[True] * K, [k % 2 == 0 for k in range(K)]]
        for aware in flags:
            got = group_dual_stream_mask(torch.tensor(groups), B, L, group_aware=torch.tensor(aware))
            assert torch.equal(got, _rules(groups, B, L, list(aware))), (sizes, aware)


@pytest.mark.parametrize("L,B", [(1, 1), (8, 2), (12, 4), (10, 4), (7, 16), (9, 3)])
def test_singleton_groups_are_bd_training_mask(L, B):
    K = -(-L // B)
    assert torch.equal(group_dual_stream_mask(torch.arange(K), B, L), bd_training_mask(L, B))
    # non-aware blocks follow plain TF rules, so any layout with no aware block is TF too
    coarse = torch.zeros(K, dtype=torch.long)
    assert torch.equal(group_dual_stream_mask(coarse, B, L, group_aware=torch.zeros(K, dtype=torch.bool)),
                       bd_training_mask(L, B))


def test_mask_is_batched_over_layouts_and_ids_need_not_be_consecutive():
    layouts = [(2, 2), (1, 3), (4,), (1, 1, 1, 1)]
    groups = torch.stack([group_ids(s) for s in layouts])  # (4, 4)
    batched = group_dual_stream_mask(groups, 3)
    assert batched.shape == (4, 24, 24)
    for r, s in enumerate(layouts):
        assert torch.equal(batched[r], group_dual_stream_mask(group_ids(s), 3))
    assert torch.equal(group_dual_stream_mask(torch.tensor([5, 5, 9, 9]), 3), batched[0])
    assert group_starts(torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]])).tolist() == [[0, 0, 2, 2, 2, 5],
                                                                                                [0, 1, 1, 1, 4, 4]]


def test_noisy_block_sees_exactly_its_running_set():
    """Training logits of a noisy block k in a group starting at α equal an inference forward of
    [clean prefix < α ; noisy blocks α..k] under the Block Buffer's block-causal mask."""
    B, L = 4, 20
    model = tiny_llama(vocab=VOCAB + 1, seed=3)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, VOCAB, (1, L), generator=g)  # (1, L)
    noisy = torch.where(torch.rand(1, L, generator=g) < 0.5, MASK, clean)  # (1, L)
    sizes = (2, 3)
    groups = torch.tensor([0, 0, 1, 1, 1])
    mask = group_dual_stream_mask(groups, B)[None, None]  # (1, 1, 2L, 2L)
    pos = torch.arange(L).repeat(2)[None]  # (1, 2L)
    with torch.no_grad():
        train_logits = model(input_ids=torch.cat([noisy, clean], 1), position_ids=pos, attention_mask=mask).logits
        for k in range(5):
            alpha = 0 if k < sizes[0] else sizes[0]
            seq = torch.cat([clean[:, : alpha * B], noisy[:, alpha * B : (k + 1) * B]], 1)  # (1, (k+1)B)
            n = seq.shape[1]
            ref = model(input_ids=seq, position_ids=torch.arange(n)[None],
                        attention_mask=block_causal_mask(n, B)[None, None]).logits
            torch.testing.assert_close(train_logits[:, k * B : (k + 1) * B], ref[:, -B:], atol=1e-5, rtol=1e-5)


def test_mask_refuses_bad_input():
    with pytest.raises(UnmaskError, match="non-decreasing"):
        group_dual_stream_mask(torch.tensor([0, 1, 0]), 2)
    with pytest.raises(UnmaskError, match="blocks"):
        group_dual_stream_mask(torch.tensor([0, 1]), 2, L=7)
    with pytest.raises(UnmaskError, match="integer group ids"):
        group_dual_stream_mask(torch.tensor([0.0, 1.0]), 2)
    with pytest.raises(UnmaskError, match="block_size"):
        group_dual_stream_mask(torch.tensor([0, 1]), 0)
    with pytest.raises(UnmaskError, match="K >= 1"):
        group_dual_stream_mask(torch.zeros(0, dtype=torch.long), 2)
    with pytest.raises(UnmaskError, match="bool"):
        group_dual_stream_mask(torch.tensor([0, 1]), 2, group_aware=torch.tensor([1, 0]))
    with pytest.raises(UnmaskError, match="broadcast"):
        group_dual_stream_mask(torch.tensor([0, 1]), 2, group_aware=torch.tensor([True, False, True]))


# ---------------------------------------------------------------------------------------------
# Layouts (§4.1)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g_max", [2, 3, 4, 5])
@pytest.mark.parametrize("K", [1, 2, 5, 9, 12])
def test_systematic_layouts_count_and_coverage(K, g_max):
    layouts = systematic_layouts(K, g_max)
    assert len(layouts) == (g_max + 2) * (g_max - 1) // 2
    assert all(sum(s) == K and min(s) >= 1 for s in layouts)
    first = 0
    for g in range(2, g_max + 1):
        family = layouts[first : first + g]  # the g shifts of size g, h = 0..g-1
        first += g
        spans = []
        for s in family:
            starts = [0] + torch.tensor(s).cumsum(0).tolist()[:-1]
            spans.append({tuple(range(a, a + n)) for a, n in zip(starts, s)})
        for a in range(K - g + 1):  # every run of g blocks is a group in exactly one layout of size g
            run = tuple(range(a, a + g))
            assert sum(run in sp for sp in spans) == 1 and run in spans[a % g], (g, a)
        for k in range(K):  # every block sits in every slot of a size-g group (room permitting)
            for slot in range(g):
                if k - slot >= 0 and k - slot + g <= K:
                    assert any(tuple(range(k - slot, k - slot + g)) in sp for sp in spans), (g, k, slot)


def test_systematic_layouts_examples():
    assert systematic_layouts(5, 2) == [(2, 2, 1), (1, 2, 2)]
    assert systematic_layouts(7, 3)[2:] == [(3, 3, 1), (1, 3, 3), (2, 3, 2)]


@pytest.mark.parametrize("g_max", [2, 3, 4])
def test_random_layouts(g_max):
    g = torch.Generator().manual_seed(0)
    seen_orders = set()
    for K in range(1, 14):
        for _ in range(40):
            paper = random_layout(K, g_max, g, code_fixups=False)
            assert sum(paper) == K and all(2 <= s <= g_max for s in paper[:-1]) and 1 <= paper[-1] <= g_max
            code = random_layout(K, g_max, g)
            assert sum(code) == K and max(code) <= g_max
            if g_max >= 3 and K >= 2:
                assert min(code) >= 2, code  # a singleton remainder is absorbed or split
            seen_orders.add(code)
    assert any(s[-1] > s[0] for s in seen_orders)  # permuted: not always non-increasing
    a = [random_layout(20, 4, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert a[0] == a[1]  # deterministic for a seed


def test_layout_refuses_bad_input():
    with pytest.raises(UnmaskError, match="G_max"):
        systematic_layouts(4, 1)
    with pytest.raises(UnmaskError, match="K must"):
        random_layout(0, 3, torch.Generator())
    with pytest.raises(UnmaskError, match="positive"):
        group_ids([2, 0])


# ---------------------------------------------------------------------------------------------
# Chain-uniform scheduler (§4.2)
# ---------------------------------------------------------------------------------------------


def test_t_eff():
    assert ChainUniform().t_eff == pytest.approx(0.99001)
    assert ChainUniform(0.2, 0.8, 0.0).t_eff == pytest.approx(0.8)
    assert ChainUniform(0.2, 0.8, 1.0).t_eff == pytest.approx(0.2)
    assert ChainUniform(0.2, 0.8, 0.5).t_eff == pytest.approx(0.5)
    for bad in [dict(t_low=0.5, t_high=0.4), dict(t_low=-0.1), dict(t_high=1.5), dict(rho=1.5), dict(rho=-0.1)]:
        with pytest.raises(UnmaskError):
            ChainUniform(**bad)


@pytest.mark.parametrize("sched", [ChainUniform(), ChainUniform(0.2, 0.7, 0.1), ChainUniform(0.3, 0.3, 0.0)])
def test_chain_uniform_ranges_monotone_within_groups_and_restarts(sched):
    g = torch.Generator().manual_seed(0)
    groups = group_ids((3, 2, 4, 1))
    restarts = 0
    for _ in range(300):
        t = chain_uniform_ratios(groups, sched, g)
        assert t.shape == (10,) and t.dtype == torch.float32
        assert bool((t >= sched.t_low - 1e-6).all()) and bool((t <= sched.t_eff + 1e-6).all())
        for a, b in [(0, 3), (3, 5), (5, 9)]:
            assert bool((t[a + 1 : b] >= t[a : b - 1]).all())  # non-decreasing inside a group
        restarts += int(t[3] < t[2]) + int(t[5] < t[4])
    if sched.t_eff > sched.t_low:
        assert restarts > 100  # each group starts from a fresh floor


def test_chain_uniform_moments_and_prompt_blocks():
    sched = ChainUniform(0.0, 1.0, 0.0)
    g = torch.Generator().manual_seed(1)
    t = torch.stack([chain_uniform_ratios(group_ids((2,)), sched, g) for _ in range(4000)])  # (N, 2)
    # ℓ ~ U(0,1), t1 ~ U(ℓ,1): E[t1] = 3/4; t2 ~ U(t1,1): E[t2] = 7/8
    assert t[:, 0].mean().item() == pytest.approx(0.75, abs=0.015)
    assert t[:, 1].mean().item() == pytest.approx(0.875, abs=0.015)
    chained = torch.tensor([False, True, True])
    t = chain_uniform_ratios(group_ids((3,)), ChainUniform(chain_over_prompt=False), g, chained)
    assert t[0] == 0 and t[1] > 0 and t[2] >= t[1]


# ---------------------------------------------------------------------------------------------
# Objective (§4.4)
# ---------------------------------------------------------------------------------------------


def test_multitf_batch_layout():
    B, L, R = 4, 24, 2
    obj = MultiTFObjective(mask_token_id=MASK, block_size=B, g_max=3, n_rand=2)
    assert obj.n_layouts == 5 + 2
    chunks = torch.randint(3, VOCAB, (R, L + 1), generator=torch.Generator().manual_seed(0))
    b = obj.batch(chunks, torch.Generator().manual_seed(1))
    N = R * obj.n_layouts
    assert b["input_ids"].shape == (N, 2 * L) and b["labels"].shape == (N, L)
    assert b["attention"].shape == (N, 2 * L, 2 * L)
    assert b["row"].tolist() == [r for r in range(R) for _ in range(obj.n_layouts)]
    K = L // B
    for n in range(N):
        clean = chunks[b["row"][n], :L]
        noise = b["noise_mask"][n]
        assert torch.equal(b["input_ids"][n, L:], clean) and torch.equal(b["input_ids"][n, :L][~noise], clean[~noise])
        assert bool((b["input_ids"][n, :L][noise] == MASK).all()) and not bool(noise[0])  # BOS never masked
        assert torch.equal(b["labels"][n], torch.where(noise, clean, IGNORE))
        valid = torch.full((K,), B)
        valid[0] = B - 1
        counts = (valid.double() * b["ratios"][n].double()).floor().long()
        assert noise.view(K, B).sum(-1).tolist() == counts.tolist()
        assert torch.equal(b["attention"][n], group_dual_stream_mask(b["groups"][n], B))
    sizes = [tuple(torch.unique_consecutive(b["groups"][n], return_counts=True)[1].tolist()) for n in range(5)]
    assert sizes == systematic_layouts(K, 3)


def test_layouts_per_row_and_presets():
    obj = MultiTFObjective.preset("sdar-b4", mask_token_id=MASK, block_size=4, layouts_per_row=3)
    assert (obj.g_max, obj.n_rand, obj.n_layouts) == (4, 2, 11)
    b = obj.batch(torch.randint(3, VOCAB, (2, 33)), torch.Generator().manual_seed(0))
    assert b["input_ids"].shape[0] == 6
    assert set(PRESETS) >= {"llada2", "sdar-b32"}
    for bad in [dict(g_max=1), dict(n_rand=-1), dict(layouts_per_row=12), dict(rounding="round"), dict(block_size=0),
                dict(prompt_len=-1)]:
        with pytest.raises(UnmaskError):
            MultiTFObjective(**{"mask_token_id": MASK, "block_size": 4, **bad})
    with pytest.raises(UnmaskError, match="preset"):
        MultiTFObjective.preset("nope", mask_token_id=MASK, block_size=4)
    with pytest.raises(UnmaskError, match="multiple of the block size"):
        obj.batch(torch.randint(3, VOCAB, (2, 31)), torch.Generator())


def test_multitf_loss_decreases_in_20_steps():
    torch.manual_seed(0)
    model = with_mask_row(tiny_llama(vocab=VOCAB, seed=0).train())
    obj = MultiTFObjective(mask_token_id=MASK, block_size=4, g_max=3, n_rand=1)
    g = torch.Generator().manual_seed(0)
    motifs = torch.randint(3, VOCAB, (4, 3), generator=g)  # (4, 3): learnable repeated motifs
    chunks = motifs.repeat(1, 9)[:, :25]  # (4, 25)
    eval_g = 1234

    def val() -> float:
        with torch.no_grad():
            return float(masked_ce_loss(model, obj.batch(chunks, torch.Generator().manual_seed(eval_g)), MASK)[0])

    before = val()
    terms = descend(model, obj, chunks, g, steps=20, lr=1e-2)
    assert val() < 0.6 * before and set(terms) == {"mat", "acc", "masked"}


# ---------------------------------------------------------------------------------------------
# train_multitf and the CLI
# ---------------------------------------------------------------------------------------------


def test_train_multitf_end_to_end(tmp_path, capsys):
    import unmask
    from unmask.train.block_diffusion import train_block_diffusion
    from unmask.train.multitf import train_multitf

    data = ids_file(tmp_path / "d.jsonl")
    bd = tmp_path / "bd"
    train_block_diffusion(base="stories260K", block_size=8, data=data, out=bd, **SMALL_RUN)
    mbd = tmp_path / "mbd"
    result = train_multitf(base=str(bd), data=data, out=mbd, g_max=2, n_rand=1, **SMALL_RUN)
    assert result.out == mbd and result.step == 3
    bundle = unmask.load(str(mbd))
    assert bundle.kind == "block-diffusion" and bundle.block_size == 8 and bundle.mask_token_id == 512
    meta = json.loads((mbd / "unmask_config.json").read_text())
    assert meta["train_g_max"] == 2 and meta["training"]["objective_config"]["n_rand"] == 1
    assert meta["training"]["objective_config"]["scheduler"]["rho"] == 0.01
    for decoder in ("block", "multiblock"):
        gen = unmask.generate(["Once upon a time"], bundle, decoder, max_new_tokens=12)
        assert gen.stats.nfe >= 1 and len(gen.tokens[0]) <= 12
    with pytest.raises(UnmaskError, match="block-diffusion model"):
        train_multitf(base="stories260K", data=data, out=tmp_path / "x", **SMALL_RUN)
    with pytest.raises(UnmaskError, match="G_max"):
        train_multitf(base=str(bd), data=data, out=tmp_path / "x", g_max=1, **SMALL_RUN)
    with pytest.raises(UnmaskError, match="rounding"):
        train_multitf(base=str(bd), data=data, out=tmp_path / "x", rounding="up", **SMALL_RUN)
    code, out, err = run_cli(capsys, "train", "multitf", "--base", bd, "--data", data, "--out", tmp_path / "cli",
                             "--seq-len", "32", "--steps", "2", "--g-max", "2", "--n-rand", "0", "--warmup", "1",
                             "--eval-every", "0")
    assert code == 0 and "after 2 steps" in out
    code, out, err = run_cli(capsys, "train", "multitf", "--base", "stories260K", "--data", data, "--out",
                             tmp_path / "c2")
    assert code == 2 and "block-diffusion" in err and err.count("\n") == 1
