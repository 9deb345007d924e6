"""Block Buffer ``multiblock`` decoder (multiblock.md §3): exact cache, static shapes, the slot state
machine on a scripted model, N_buf = 1 == SingleBD, batch invariance, stats and bad inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_batch_equals_single_rows, tiny_bundle
from test_block_decode import bd_bundle, scripted_bundle, uncached_logits

import unmask
from unmask.decode import DECODERS, spec_for
from unmask.errors import UnmaskError


def tok(p):
    return (p * 7) % 50 + 3


def check_window_logits(bundle, prompt, final, state, row, B):
    """The window logits of ``row`` == an uncached block-causal forward over prefix + window."""
    start = int(state["positions"][row, 0])
    window = state["inp"][row].tolist()
    want = uncached_logits(bundle, final[:start] + window, B)[-len(window):, :-1]
    torch.testing.assert_close(state["logits"][row, :, :-1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_cached_window_logits_equal_uncached_block_causal_forward(arch, impl):
    bundle = bd_bundle(arch, impl)
    prompt = [1, 5, 9, 12, 7, 3]
    seen = []
    out = DECODERS["multiblock"].decode(bundle, [prompt], max_new_tokens=15, slots=3, tau_add=0.25, tau_semi=0.5, tau_m2t=0.5,
                            on_forward=seen.append)
    final = prompt + out.tokens[0]
    assert len(out.tokens[0]) == 15
    assert any(int(s["stored"][0]) for s in seen)  # some forwards stored blocks
    assert max((s["window"].state[0] != 0).sum() for s in seen) >= 2  # and several blocks ran together
    for s in seen:
        check_window_logits(bundle, prompt, final, s, 0, 4)


def test_batched_rows_with_different_cache_layouts_are_exact():
    # rows store blocks at different steps, so each sees scratch columns of the others: masked out
    bundle = bd_bundle("llama", "eager", seed=1)
    prompts = [[1, 5, 9], [1, 4, 8, 15, 16, 3, 2, 9, 9], [1, 2, 3, 4]]
    seen = []
    out = DECODERS["multiblock"].decode(bundle, prompts, max_new_tokens=10, slots=2, tau_add=0.5, tau_m2t=0.6,
                            on_forward=seen.append)
    assert any(len(set(s["stored"].tolist())) > 1 for s in seen)
    for r, p in enumerate(prompts):
        final = p + out.tokens[r]
        live = out.stats.nfe_per_row[r]
        for s in seen[:live]:
            check_window_logits(bundle, p, final, s, r, 4)


def test_every_forward_has_the_same_input_shape():
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    prompts = [[1, 3], [1, 3, 5, 7, 9], [1] + list(range(3, 14))]
    shapes, growth = [], []
    out = DECODERS["multiblock"].decode(bundle, prompts, max_new_tokens=17, slots=3, tau_m2t=0.8,
                            on_forward=lambda s: (shapes.append((tuple(s["inp"].shape), tuple(s["positions"].shape),
                                                                 tuple(s["logits"].shape[:2]))),
                                                  growth.append(s["cache"][0][0].shape[-2] - s["past"])))
    assert len(shapes) == out.stats.nfe > 3
    assert set(shapes) == {((3, 12), (3, 12), (3, 12))}  # (R, N_buf * B) at every step forward
    assert set(growth) <= {0, 4, 8, 12}  # the cache only ever keeps whole stored blocks


def test_state_machine_step_by_step_on_a_scripted_model():
    conf = {4: 0.99, 5: 0.6, 6: 0.55, 7: 0.5, 8: 0.99, 9: 0.99, 10: 0.6, 11: 0.5}  # distinct: no ties
    bundle = scripted_bundle(lambda p: conf.get(p, 0.99))
    windows, stored = [], []
    out = DECODERS["multiblock"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=12, slots=2, tau_add=0.5, tau_semi=0.9,
                            tau_m2t=0.9,
                            on_forward=lambda s: (windows.append(s["window"]), stored.append(int(s["stored"][0]))))
    M = 63
    got = [(w.describe(0), w.front.item(), w.tokens[0].flatten().tolist()) for w in windows]
    assert got == [
        # 1: block 1 active (progress 0 < tau_add): position 4 (0.99) is committed
        (["active", "dummy"], 1, [M] * 8),
        # 2: nothing above tau_M2T, forced top-1 (slot 0 always may): position 5
        (["active", "dummy"], 1, [tok(4), M, M, M] + [M] * 4),
        # 3: progress 0.5 >= tau_add activates block 2; slot 0 forces 6, slot 1 commits 8 and 9 (> 0.9)
        (["active", "active"], 1, [tok(4), tok(5), M, M] + [M] * 4),
        # 4: slot 0 forces 7 and is complete -> to-cache; slot 1 may not force: its predecessor was at 0.75 < tau_semi
        (["active", "active"], 1, [tok(4), tok(5), tok(6), M, tok(8), tok(9), M, M]),
        # 5: this forward stores block 1 (then popped); slot 1 forces 10 (predecessor complete)
        (["to-cache", "active"], 1, [tok(4), tok(5), tok(6), tok(7), tok(8), tok(9), M, M]),
        # 6: block 2 at 0.75 activates block 3; slot 0 forces 11 and completes, block 3 commits all (0.99):
        # both are marked to-cache, the last block is admitted and everything is complete -> finished, never stored
        (["active", "active"], 2, [tok(8), tok(9), tok(10), M] + [M] * 4),
    ]
    assert stored == [0, 0, 0, 0, 1, 0]
    assert out.tokens[0] == [tok(p) for p in range(4, 16)]
    assert out.stats.nfe == 6 and out.stats.tpf == pytest.approx(2.0)
    row = out.stats.extra["row_extra"][0]
    assert row["running_set"] == [1, 1, 2, 2, 2, 2] and row["accepts"] == [1, 1, 3, 1, 1, 5]
    assert row["mean_running_set"] == pytest.approx(10 / 6) == out.stats.extra["mean_running_set"]


def test_single_slot_has_the_storing_bubble_and_backup_activation():
    bundle = scripted_bundle(lambda p: 0.99)
    windows = []
    out = DECODERS["multiblock"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=8, slots=1, tau_m2t=0.9,
                            on_forward=lambda s: windows.append(s["window"].describe(0)))
    # block 1 in one step, a store step (to-cache, no dummy to activate), backup activation of block 2
    assert windows == [["active"], ["to-cache"], ["active"]]
    assert out.stats.nfe == 3 and out.stats.extra["row_extra"][0]["running_set"] == [1, 1, 1]


@pytest.mark.parametrize("prompts", [[[1, 5, 9, 12, 7]], [[1, 3], [1, 3, 5, 7, 9, 11, 2, 4], [1, 8, 8, 8]]])
def test_single_slot_reproduces_the_block_decoder(prompts):
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    for tau in (0.3, 0.8):
        kw = dict(max_new_tokens=13, stop_token_ids=(2,))
        ref = DECODERS["block"].decode(bundle, prompts, tau=tau, **kw)
        got = DECODERS["multiblock"].decode(bundle, prompts, slots=1, tau_m2t=tau, **kw)
        assert got.tokens == ref.tokens
        assert got.stats.nfe_per_row == ref.stats.nfe_per_row
        # multiblock logs 0 commits on its store steps; the block decoder logs denoising forwards only
        assert [[a for a in r["accepts"] if a] for r in got.stats.extra["row_extra"]] == \
            [r["accepts"] for r in ref.stats.extra["row_extra"]]


def test_single_slot_reproduces_the_block_decoder_step_for_step_on_a_scripted_model():
    bundle = scripted_bundle(lambda p: [0.99, 0.3, 0.97, 0.6][p % 4])
    ref = DECODERS["block"].decode(bundle, [[1, 2, 3, 4, 5, 6]], max_new_tokens=14, tau=0.95)
    got = DECODERS["multiblock"].decode(bundle, [[1, 2, 3, 4, 5, 6]], max_new_tokens=14, slots=1, tau_m2t=0.95)
    # blocks 1..4: 2 + 3 + 3 + 3 denoising forwards and 3 store forwards
    assert got.tokens == ref.tokens and got.stats.nfe == ref.stats.nfe == 14
    # block decoder: accepts per denoising forward; multiblock: per step, 0 on the store steps
    assert [a for a in got.stats.extra["row_extra"][0]["accepts"] if a] == ref.stats.extra["row_extra"][0]["accepts"]


def test_batch_of_rows_equals_single_rows():
    bundle = bd_bundle("llama", "sdpa", seed=3, initializer_range=0.4)
    prompts = [[1] + list(range(3, 3 + n)) for n in (1, 4, 2, 9, 5, 3, 7, 6)]
    batch = assert_batch_equals_single_rows(DECODERS["multiblock"].decode, bundle, prompts, max_new_tokens=14, slots=3,
                                            tau_add=0.3, tau_semi=0.5, tau_m2t=0.7, stop_token_ids=(2, 11))
    assert len(set(batch.stats.nfe_per_row)) > 1  # rows finish at different steps


def test_a_finished_row_departs_without_waiting():
    stop = tok(5)
    bundle = scripted_bundle(lambda p: 0.99)
    out = DECODERS["multiblock"].decode(bundle, [[1, 2, 3, 4], [1, 2, 3, 4, 9, 9, 9, 9]], max_new_tokens=12, slots=2,
                            tau_m2t=0.9, stop_token_ids=(stop,))
    assert out.tokens[0] == [tok(4)]  # cut before the stop token at position 5
    assert out.tokens[1] == [tok(p) for p in range(8, 20)]
    assert out.stats.nfe_per_row[0] == 1 and out.stats.nfe_per_row[1] > 1
    assert out.stats.nfe == out.stats.nfe_per_row[1]
    assert len(out.stats.extra["row_extra"][0]["running_set"]) == 1


def test_eos_stops_admission_and_blocks_after_it_do_not_matter():
    # the stop token (position 9, block 2) is committed late, after block 3 was admitted; block 3 keeps a
    # mask (position 13) but the row ends as soon as every block up to the stop's block is complete
    conf = {9: 0.2, 13: 0.2}
    bundle = scripted_bundle(lambda p: conf.get(p, 0.99))
    windows = []
    out = DECODERS["multiblock"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=20, slots=3, tau_add=0.1, tau_m2t=0.9,
                            stop_token_ids=(tok(9),), on_forward=lambda s: windows.append(s["window"].describe(0)))
    assert windows == [["active", "dummy", "dummy"], ["to-cache", "active", "dummy"], ["active", "active", "dummy"]]
    assert out.tokens[0] == [tok(p) for p in range(4, 9)]
    assert out.stats.nfe == 3 and out.stats.extra["row_extra"][0]["running_set"] == [1, 2, 2]


def test_t2t_and_max_nfe_terminate():
    bundle = bd_bundle("llama", "sdpa", seed=2)
    out = DECODERS["multiblock"].decode(bundle, [[1, 3, 5]], max_new_tokens=12, slots=2, tau_m2t=0.5, tau_t2t=0.0)
    assert len(out.tokens[0]) == 12 and out.stats.extra["tau_t2t"] == 0.0
    capped = DECODERS["multiblock"].decode(bundle, [[1, 3, 5]], max_new_tokens=12, slots=2, tau_m2t=1.0, max_nfe=3)
    assert capped.stats.nfe == 3 and len(capped.tokens[0]) < 12


def test_defaults_and_api():
    bundle = bd_bundle("llama", "sdpa")
    out = DECODERS["multiblock"].decode(bundle, [[1, 3, 5]], max_new_tokens=6)
    extra = out.stats.extra
    got = (extra["slots"], extra["tau_add"], extra["tau_semi"], extra["tau_m2t"], extra["tau_t2t"])
    assert got == (2, 0.1, 0.9, 0.95, None)
    assert extra["block_size"] == 4
    gen = unmask.generate("5 6 7", bundle, "multiblock", max_new_tokens=8, slots=2, tau_m2t=0.5, tau_add=0.9)
    row = gen.rows()[0]
    assert row["decoder"] == "multiblock" and len(row["running_set"]) == row["nfe"]
    assert row["tpf"] == pytest.approx(len(row["tokens"]) / row["nfe"])
    with pytest.raises(UnmaskError, match="--policy does not apply"):
        unmask.generate("5 6", bundle, "multiblock", max_new_tokens=4, policy="threshold")
    assert unmask.generate("5 6", bundle, "block", max_new_tokens=4, tau=0.5).decoder == "block"


def test_bad_inputs():
    bundle = bd_bundle()
    for kw, msg in [(dict(slots=0), "--slots"), (dict(slots=1.5), "--slots"), (dict(tau_add=1.5), "--tau-add"),
                    (dict(tau_semi=-0.1), "--tau-semi"), (dict(tau_m2t=2), "--tau-m2t"),
                    (dict(tau_t2t=-1.0), "--tau-t2t"),
                    (dict(tau_stable=1.01), "--tau-stable"), (dict(max_nfe=0), "max_nfe"),
                    (dict(block_size=8), "disagrees with the checkpoint's block size 4")]:
        with pytest.raises(UnmaskError, match=msg):
            DECODERS["multiblock"].decode(bundle, [[1, 2]], max_new_tokens=4, **kw)
    with pytest.raises(UnmaskError, match="kind block-diffusion"):
        spec_for("multiblock", "masked-diffusion")
    with pytest.raises(UnmaskError, match="block-diffusion"):
        DECODERS["multiblock"].decode(tiny_bundle(bundle.model, kind="causal"), [[1, 2]], max_new_tokens=4)


def test_on_step_events_report_commits_and_slot_states():
    bundle = scripted_bundle(lambda p: 0.99)
    events = []
    DECODERS["multiblock"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=8, slots=1, tau_m2t=0.9, on_step=events.append)
    assert [e["slots"] for e in events] == [["active"], ["to-cache"], ["active"]]
    assert [e["step"] for e in events] == [0, 1, 2] and [e["blocks"] for e in events] == [[1], [1], [2]]
    assert [e["positions"] for e in events] == [[0, 1, 2, 3], [], [4, 5, 6, 7]]
    assert events[0]["tokens"] == [tok(p) for p in range(4, 8)]
    assert events[0]["canvas"] == [tok(p) for p in range(4, 8)] + [None] * 4
    assert events[-1]["canvas"] == [tok(p) for p in range(4, 12)] and events[-1]["running_set"] == 1
    block_events = []
    DECODERS["block"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=8, tau=0.9, on_step=block_events.append)
    got = [(e["step"], e["block"], e["positions"]) for e in block_events]
    assert got == [(0, 1, [0, 1, 2, 3]), (2, 2, [4, 5, 6, 7])]  # step 1 was the store forward
    assert block_events[-1]["canvas"] == events[-1]["canvas"]


def test_stop_strings_end_rows_after_complete_blocks():
    bundle = scripted_bundle(lambda p: 0.99)
    stop = f" {tok(6)}"  # IdTokenizer text of the token at position 6
    for name, kw in [("block", dict(tau=0.9)), ("multiblock", dict(slots=2, tau_m2t=0.9, tau_add=1.0))]:
        gen = unmask.generate("2 3 4", bundle, name, max_new_tokens=12, stop=[stop], **kw)
        assert gen.texts[0] == f" {tok(4)} {tok(5)}"
        assert gen.tokens[0] == [tok(p) for p in range(4, 8)]  # the block holding the stop string completes


def test_sampling_is_seeded_and_reproducible():
    bundle = bd_bundle("llama", "sdpa", seed=2)
    kw = dict(max_new_tokens=12, slots=2, tau_m2t=0.3, sampling=unmask.sampling.Sampling(temperature=1.0, seed=5))
    a, b = DECODERS["multiblock"].decode(bundle, [[1, 3, 5]], **kw), DECODERS["multiblock"].decode(bundle, [[1, 3, 5]], **kw)
    assert a.tokens == b.tokens and len(a.tokens[0]) == 12
    greedy = DECODERS["multiblock"].decode(bundle, [[1, 3, 5]], max_new_tokens=12, slots=2, tau_m2t=0.3)
    assert greedy.tokens != a.tokens


def test_single_slot_reproduces_the_block_decoder_on_exact_ties():
    # issue 15 item 12: block committed κ ≥ τ, multiblock κ > τ (SDAR / Diffulex); on κ == τ they differed.
    bundle = scripted_bundle(lambda p: [0.99, 0.6, 0.97, 0.6][p % 4])
    seen = []
    DECODERS["block"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=4, tau=0.95, on_forward=seen.append)
    tau = float(torch.softmax(seen[0]["logits"][0, 1].float(), -1).max())  # κ at the 0.6 positions, exactly
    ref = DECODERS["block"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=8, tau=tau)
    got = DECODERS["multiblock"].decode(bundle, [[1, 2, 3, 4]], max_new_tokens=8, slots=1, tau_m2t=tau)
    assert got.tokens == ref.tokens and got.stats.nfe == ref.stats.nfe
    assert [a for a in got.stats.extra["row_extra"][0]["accepts"] if a] == ref.stats.extra["row_extra"][0]["accepts"]
    assert ref.stats.extra["row_extra"][0]["accepts"][:3] == [2, 1, 1]  # κ == τ waits (inclusive: [4])
