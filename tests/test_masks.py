"""Exhaustive tests of unmask.masks against plain-Python loops of the spec rules, plus one check
on a tiny random LlamaForCausalLM (eager + additive float mask, SDPA + bool mask)."""

import pytest
import torch

from unmask.errors import UnmaskError
from unmask.masks import (
    as_4d,
    bd_training_mask,
    bd_training_position_ids,
    block_buffer_mask,
    block_causal_mask,
    causal_mask,
    decode_position_ids,
    sbd_inference_mask,
    sbd_training_mask,
    sbd_training_position_ids,
    to_additive,
    with_key_padding,
)

LENGTHS = range(1, 13)
SIZES = range(1, 7)


def loop_mask(n_q, n_kv, rule):
    rows = [[bool(rule(q, j)) for j in range(n_kv)] for q in range(n_q)]
    return torch.tensor(rows, dtype=torch.bool).reshape(n_q, n_kv)  # (q, kv), also when q == 0


def sbd_rule(L, k):
    """sbd.md §3.3 rules 1-3, verbatim."""
    half = L

    def rule(q, j):
        return (
            (q < half and j < half and j <= q)
            or (q >= half and j >= half and (q - half) // k == (j - half) // k)
            or (q >= half and j < half and (q - half) // k > j // k)
        )

    return rule


def bd_rule(L, B, noisy_first=True):
    """multiblock.md §1.3, verbatim, for X = [x_t ; x_0] (or [x_0 ; x_t])."""

    def is_noisy(p):
        return (p < L) == noisy_first

    def rule(i, j):
        bi, bj = (i % L) // B, (j % L) // B
        if is_noisy(i) and is_noisy(j):
            return bj == bi
        if is_noisy(i):
            return bj < bi
        if not is_noisy(j):
            return bj <= bi
        return False

    return rule


# ------------------------------------------------------------------ SBD


@pytest.mark.parametrize("k", SIZES)
def test_sbd_training_mask_matches_rule(k):
    for L in LENGTHS:
        m = sbd_training_mask(L, k)
        assert m.dtype == torch.bool and m.shape == (2 * L, 2 * L)
        assert torch.equal(m, loop_mask(2 * L, 2 * L, sbd_rule(L, k))), (L, k)


def test_sbd_fig8_example():
    m = sbd_training_mask(8, 4)
    clean, noisy1, noisy2 = range(0, 8), range(8, 12), range(12, 16)
    # Clean half: causal over the clean half only.
    for q in clean:
        assert m[q].nonzero().flatten().tolist() == list(range(q + 1))
    # Noisy block 1 ("x1 m x3 m") attends only to itself.
    for q in noisy1:
        assert m[q].nonzero().flatten().tolist() == list(noisy1)
    # Noisy block 2 ("m m x7 m") attends to clean x1..x4 and to itself.
    for q in noisy2:
        assert m[q].nonzero().flatten().tolist() == [0, 1, 2, 3, *noisy2]


def test_sbd_training_position_ids():
    for L in LENGTHS:
        p = sbd_training_position_ids(L)
        assert p.dtype == torch.long and p.tolist() == list(range(L)) * 2
        assert torch.equal(bd_training_position_ids(L), p)


def test_sbd_inference_mask_uncached_is_fig10():
    for L in LENGTHS:
        for c in range(L + 1):
            m = sbd_inference_mask(0, c, L - c)
            assert torch.equal(m, loop_mask(L, L, lambda q, j: j <= q or q >= c)), (L, c)


def test_sbd_inference_mask_cached_matches_rule():
    for past in range(5):
        for c in range(5):
            for n in range(6):
                m = sbd_inference_mask(past, c, n)

                def rule(i, j):  # row i of the new tokens sits at absolute position past + i
                    return j <= past + i if i < c else True

                assert m.shape == (c + n, past + c + n)
                assert torch.equal(m, loop_mask(c + n, past + c + n, rule)), (past, c, n)
                # Cached rows are the bottom rows of the uncached mask over the whole sequence.
                full = sbd_inference_mask(0, past + c, n)
                assert torch.equal(m, full[past:]), (past, c, n)


def test_sbd_training_rows_match_block_mode_rule():
    # Noisy block b in training sees exactly what block mode sees: clean x_<bk causal, block bidirectional.
    for k in SIZES:
        for L in LENGTHS:
            m = sbd_training_mask(L, k)
            for start in range(0, L, k):
                end = min(start + k, L)
                inf = sbd_inference_mask(0, start, end - start)  # (end, end) over [clean prefix ; block]
                assert torch.equal(m[L + start : L + end, :start], inf[start:, :start])
                assert torch.equal(m[L + start : L + end, L + start : L + end], inf[start:, start:])


# ------------------------------------------------------------------ block diffusion


@pytest.mark.parametrize("B", SIZES)
def test_block_causal_mask_matches_rule(B):
    for q_len in range(0, 13):
        for past in range(0, 7):
            for offset in (-3, 0, 2, 5):
                m = block_causal_mask(q_len, B, past, offset)

                def rule(i, j):
                    return (j - offset) // B <= (past + i - offset) // B

                assert torch.equal(m, loop_mask(q_len, past + q_len, rule)), (q_len, past, offset)


def test_block_size_one_is_causal():
    for q_len in range(0, 10):
        for past in range(0, 5):
            assert torch.equal(block_causal_mask(q_len, 1, past), causal_mask(q_len, past))
            assert torch.equal(causal_mask(q_len, past), loop_mask(q_len, past + q_len, lambda i, j: j <= past + i))


@pytest.mark.parametrize("B", SIZES)
@pytest.mark.parametrize("noisy_first", [True, False])
def test_bd_training_mask_matches_rule(B, noisy_first):
    for L in LENGTHS:
        m = bd_training_mask(L, B, noisy_first=noisy_first)
        assert m.shape == (2 * L, 2 * L)
        assert torch.equal(m, loop_mask(2 * L, 2 * L, bd_rule(L, B, noisy_first))), (L, B)


def test_bd_training_clean_half_is_block_causal_and_noisy_default_first():
    L, B = 10, 3
    m = bd_training_mask(L, B)
    assert torch.equal(m[L:, L:], block_causal_mask(L, B))  # clean x_0 is the second half
    assert not m[L:, :L].any()  # clean never sees noisy
    # Differs from SBD only in the clean half's intra-block visibility (after swapping halves).
    swapped = bd_training_mask(L, B, noisy_first=False)
    sbd = sbd_training_mask(L, B)
    assert torch.equal(swapped[L:], sbd[L:])
    assert torch.equal(swapped[:L, :L], block_causal_mask(L, B)) and torch.equal(sbd[:L, :L], causal_mask(L))


@pytest.mark.parametrize("B", SIZES)
def test_block_buffer_mask_matches_rule(B):
    for past in range(0, 9):
        for n in range(0, 5):
            m = block_buffer_mask(past, n, B)

            def rule(i, j):  # query row i is in slot i // B; key j < past is cached prefix
                return j < past or (j - past) // B <= i // B

            assert torch.equal(m, loop_mask(n * B, past + n * B, rule)), (past, n)
            if past % B == 0:  # block-aligned prefix: same as plain block-causal from position 0
                assert torch.equal(m, block_causal_mask(n * B, B, past))


def test_decode_position_ids():
    assert decode_position_ids(3, 4).tolist() == [3, 4, 5, 6]
    assert decode_position_ids(0, 0).numel() == 0


def test_invalid_sizes_raise():
    with pytest.raises(UnmaskError):
        sbd_training_mask(4, 0)
    with pytest.raises(UnmaskError):
        bd_training_mask(0, 2)
    with pytest.raises(UnmaskError):
        block_causal_mask(4, 0)
    with pytest.raises(UnmaskError):
        sbd_inference_mask(-1, 2, 2)


# ------------------------------------------------------------------ conversions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_to_additive_values(dtype):
    m = sbd_training_mask(5, 2)
    a = to_additive(m, dtype)
    assert a.dtype == dtype and a.shape == m.shape
    assert torch.all(a[m] == 0)
    assert torch.all(a[~m] == torch.finfo(dtype).min)
    assert torch.isfinite(a).all()
    with pytest.raises(TypeError):
        to_additive(a)
    with pytest.raises(TypeError):
        to_additive(m, torch.int64)


def test_as_4d_shapes():
    m = causal_mask(3, 2)  # (3, 5)
    assert as_4d(m).shape == (1, 1, 3, 5)
    assert as_4d(m, batch=4).shape == (4, 1, 3, 5)
    assert torch.equal(as_4d(m, batch=4)[2, 0], m)
    b = torch.stack([m, ~m])  # (2, 3, 5)
    assert torch.equal(as_4d(b)[1, 0], ~m)
    assert as_4d(b, batch=2).shape == (2, 1, 3, 5)
    assert as_4d(as_4d(b)).shape == (2, 1, 3, 5)
    with pytest.raises(ValueError):
        as_4d(b, batch=3)
    with pytest.raises(ValueError):
        as_4d(torch.ones(5, dtype=torch.bool))


def test_with_key_padding():
    past, q = 2, 4
    kv = past + q
    base = as_4d(causal_mask(q, past), batch=3)  # (3, 1, 4, 6)
    key_valid = torch.ones(3, kv, dtype=torch.bool)
    key_valid[1, :2] = False  # two left-padded keys (cached)
    key_valid[2, :4] = False  # padding runs into the new tokens: rows 0-1 see nothing
    out = with_key_padding(base, key_valid)
    assert out.shape == (3, 1, q, kv)
    assert torch.equal(out[0], base[0])
    expected1 = base[1, 0] & key_valid[1]
    assert torch.equal(out[1, 0], expected1)
    for i in range(q):
        row = out[2, 0, i]
        if (base[2, 0, i] & key_valid[2]).any():  # non-empty rows are only padded
            assert torch.equal(row, base[2, 0, i] & key_valid[2])
        else:  # empty rows keep exactly their own key
            assert row.nonzero().flatten().tolist() == [past + i]
    assert out.any(-1).all()  # never an all-masked row
    # Explicit past_len for a StaticCache-like layout (kv longer than past + q).
    wide = torch.zeros(1, 1, q, 10, dtype=torch.bool)
    out = with_key_padding(wide, torch.zeros(2, 10, dtype=torch.bool), past_len=3)
    assert out.shape == (2, 1, q, 10)
    assert [r.nonzero().flatten().tolist() for r in out[1, 0]] == [[3], [4], [5], [6]]
    with pytest.raises(ValueError):
        with_key_padding(wide, torch.ones(2, 10, dtype=torch.bool), past_len=8)
    with pytest.raises(TypeError):
        with_key_padding(to_additive(base), key_valid)


# ------------------------------------------------------------------ tiny Llama


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval().float()


def _logits(model, ids, mask4d, pos, impl):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask4d, position_ids=pos).logits  # (B, T, V)


def test_llama_sbd_training_mask_isolation_and_backends(tiny_llama):
    L, k, b = 10, 4, 1  # blocks [0..3], [4..7], [8..9] (short tail)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 63, (1, L), generator=g)  # (1, L)
    noisy = torch.where(torch.rand(1, L, generator=g) < 0.5, 63, clean)  # (1, L), 63 = mask id
    ids = torch.cat([clean, noisy], 1)  # (1, 2L)
    pos = sbd_training_position_ids(L)[None]  # (1, 2L)
    mask = as_4d(sbd_training_mask(L, k))  # (1, 1, 2L, 2L)

    eager = _logits(tiny_llama, ids, to_additive(mask), pos, "eager")
    sdpa = _logits(tiny_llama, ids, mask, pos, "sdpa")
    torch.testing.assert_close(eager, sdpa, atol=1e-5, rtol=0)

    # Perturb one noisy token in block b.
    perturbed = ids.clone()
    perturbed[0, L + b * k + 1] = (perturbed[0, L + b * k + 1] + 7) % 63
    in_block = torch.zeros(2 * L, dtype=torch.bool)
    in_block[L + b * k : L + (b + 1) * k] = True
    for impl, m in (("eager", to_additive(mask)), ("sdpa", mask)):
        base = eager if impl == "eager" else sdpa
        new = _logits(tiny_llama, perturbed, m, pos, impl)
        torch.testing.assert_close(new[0, ~in_block], base[0, ~in_block], atol=1e-6, rtol=0)
        assert (new[0, in_block] - base[0, in_block]).abs().max() > 1e-3  # the block itself does see it

    # Clean half equals a plain causal forward; noisy block b equals block mode (sbd.md §1).
    causal = _logits(tiny_llama, clean, None, pos[:, :L], "sdpa")
    torch.testing.assert_close(sdpa[0, :L], causal[0], atol=1e-5, rtol=0)
    block_ids = torch.cat([clean[:, : b * k], noisy[:, b * k : (b + 1) * k]], 1)  # (1, (b+1)k)
    block_mask = as_4d(sbd_inference_mask(0, b * k, k))  # (1, 1, (b+1)k, (b+1)k)
    block = _logits(tiny_llama, block_ids, block_mask, pos[:, : (b + 1) * k], "sdpa")
    torch.testing.assert_close(sdpa[0, in_block], block[0, b * k :], atol=1e-5, rtol=0)
