"""Router training (spec/early_bird.md §3.3–§3.4, §4.3–§4.4): Blockwise-Masking, the LBS loss,
response padding, replay labels and the oracle rule on hand-made trajectories, trace-level split,
weighted BCE, τ_ψ selection against the FP budget, tiny end-to-end runs and the CLI."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import run_cli, tiny_bundle, tiny_llama

from unmask.errors import UnmaskError
from unmask.models.mask_token import add_mask_token
from unmask.routers import LPSConfig, load_router
from unmask.train import routers as tr

L, LB = 16, 4


def dllm(shift=1, stops=(2,)):
    model = tiny_llama(vocab=64, seed=0, initializer_range=0.4)
    mask = add_mask_token(model)
    bundle = tiny_bundle(model, kind="masked-diffusion", mask_token_id=mask, stop_token_ids=stops)
    bundle.logit_shift = shift
    return bundle


PROMPTS = [[1, 5, 9], [1, 7], [1, 3, 4, 5, 6], [1, 8, 8], [1, 11], [1, 12, 13], [1, 20], [1, 21, 22]]


# -- LBS pieces -------------------------------------------------------------------------------------------


def test_blockwise_mask_clean_prefix_partial_block_masked_suffix():
    g = torch.Generator().manual_seed(0)
    m = tr.blockwise_mask(400, 32, 8, g)
    assert m.shape == (400, 32)
    ratios = []
    for row in m:
        blocks = row.view(4, 8)  # (blocks, L_B)
        full = blocks.all(dim=1)
        n = int((blocks.any(dim=1)).long().argmax())  # the first block holding a mask is block n
        assert not blocks[:n].any() and blocks[n].any() and full[n + 1:].all()
        ratios.append(float(blocks[n].float().mean()))
    assert {int(row.view(4, 8).any(dim=1).long().argmax()) for row in m} == {0, 1, 2, 3}
    assert 0.3 < sum(ratios) / len(ratios) < 0.7  # r ~ U(0, 1]
    with pytest.raises(UnmaskError, match="divisible"):
        tr.blockwise_mask(1, 30, 8, g)


def test_lbs_loss_is_eq3_per_sample():
    logits = torch.tensor([[0.0, 2.0, -1.0, float("-inf")], [1.0, 1.0, 1.0, 1.0]])
    ce = torch.tensor([[1.0, 0.5, 3.0, 9.0], [2.0, 2.0, 0.0, 0.0]])
    masked = torch.tensor([[True, True, True, False], [True, True, False, False]])
    s = torch.sigmoid(logits)
    row0 = (s[0, :3] * ce[0, :3]).sum() / 3 - s[0, :3].sum() / 3
    row1 = (s[1, :2] * ce[1, :2]).sum() / 2 - s[1, :2].sum() / 2
    assert torch.allclose(tr.lbs_loss(logits, ce, masked), (row0 + row1) / 2)
    # including only well-predicted positions (CE < 1) makes the loss negative
    assert tr.lbs_loss(torch.tensor([[9.0, -9.0]]), torch.tensor([[0.1, 5.0]]), torch.ones(1, 2, dtype=torch.bool)) < 0


def test_pad_response_keeps_the_text_and_the_stop_id_the_model_ended_on():
    assert tr.pad_response([5, 6, 1, 7, None], (2, 1), 6, 2) == [5, 6, 1, 1, 1, 1]
    assert tr.pad_response([5, None, 7], (2,), 4, 2) == [5, 2, 2, 2]
    assert tr.pad_response([5, 6, 7, 8, 9], (2,), 4, 2) == [5, 6, 7, 8]


def test_lbs_inputs_are_the_router_features_of_one_frozen_forward():
    bundle = dllm()
    resp = torch.randint(3, 60, (2, L))
    masked = tr.blockwise_mask(2, L, LB, torch.Generator().manual_seed(1))
    h, e, ce = tr.lbs_inputs(bundle, PROMPTS[:2], resp, masked)
    assert h.shape == ce.shape == (2, L) and e.shape == (2, L, 32)
    assert (h >= 0).all() and (h <= 1).all() and (ce >= 0).all() and not h.requires_grad


def test_train_lbs_end_to_end_and_round_trip(tmp_path):
    bundle = dllm()
    resp = tr.generate_responses(bundle, PROMPTS, gen_length=L, block_size=LB, policy="threshold", batch_size=4)
    assert len(resp) == len(PROMPTS) and all(len(r) == L for r in resp)
    lbs, report = tr.train_lbs(bundle, PROMPTS, resp, tr.LBSTrainConfig(block=LB, epochs=2, batch_size=4, lr=1e-3,
                                                                        val_fraction=0.25))
    assert report["epochs"] == 2 and len(report["val_loss"]) == 2 and report["samples"] == 6
    assert lbs.config.gen_length == L and lbs.config.vocab_size == 65 and not lbs.training
    tr.save_lbs(lbs, bundle, tmp_path, report)
    back, info = load_router(tmp_path, "lbs")
    assert info["base_model"]["vocab_size"] == 65 and info["training"]["epochs"] == 2
    assert all(torch.equal(a, b) for a, b in zip(lbs.state_dict().values(), back.state_dict().values()))


# -- LPS traces: labels and the oracle replay ---------------------------------------------------------------


def test_labels_on_a_hand_made_trajectory():
    x0 = torch.tensor([5, 8, 9, 2])
    top1 = [torch.tensor([5, 7, 9]), torch.tensor([8]), torch.tensor([2, 3])]
    where = [torch.tensor([0, 1, 2]), torch.tensor([1]), torch.tensor([3, 2])]
    got = tr.label_records(top1, where, x0)
    assert [g.tolist() for g in got] == [[True, False, True], [True], [True, False]]


def test_oracle_replay_follows_the_recorded_schedule_with_the_final_tokens():
    bundle = dllm(shift=0)
    x0 = torch.randint(3, 60, (1, L))  # a convergence target the model did not produce
    blocks = [torch.arange(0, 4), torch.arange(0, 4), torch.tensor([4, 6, 8]), torch.arange(9, 16)]
    commits = [torch.tensor([1, 2]), torch.tensor([0, 3]), torch.tensor([4, 6, 8]), torch.arange(9, 16)]
    schedule = [list(zip(blocks, commits))]
    recs = tr.replay_traces(bundle, [[1, 5]], schedule, x0)
    assert [(r, t, len(y)) for r, t, _, y in recs] == [(0, 0, 4), (0, 1, 2), (0, 2, 3), (0, 3, 7)]
    # step 1 sees positions 1, 2 written with x_0's tokens: its records cover only 0 and 3
    mask = bundle.mask_token_id
    canvas = torch.tensor([[1, 5] + [mask] * L])
    canvas[0, 2 + 1], canvas[0, 2 + 2] = x0[0, 1], x0[0, 2]
    logits = bundle.model(canvas, position_ids=torch.arange(L + 2)[None], is_causal=False).logits[0, 2:]
    logits[:, mask] = float("-inf")
    assert recs[1][3].tolist() == [bool(logits[i].argmax() == x0[0, i]) for i in (0, 3)]
    f = recs[2][2]  # non-contiguous block {4, 6, 8}, all masked: ρ = 1, literal pos (i − 4) / 3
    assert torch.allclose(f[:, 3], torch.ones(3)) and torch.allclose(f[:, 4], torch.tensor([0.0, 2 / 3, 4 / 3]))


def collect(bundle, lbs, **kw):
    return tr.collect_lps_traces(bundle, lbs, PROMPTS, block_size=LB, l_min=2, g_max=2, batch_size=4, **kw)


def test_single_pass_traces_equal_the_replay_under_greedy_decoding(tmp_path):
    bundle = dllm()
    torch.manual_seed(0)
    from unmask.routers import LBSConfig, LBSRouter

    lbs = LBSRouter(LBSConfig(gen_length=L, d_base=32, vocab_size=65)).eval()
    a, b = collect(bundle, lbs), collect(bundle, lbs, replay=True)
    assert a.n_traces == len(PROMPTS) and a.n_records > len(PROMPTS)
    assert torch.equal(a.offsets, b.offsets) and torch.equal(a.labels, b.labels) and torch.equal(a.trace, b.trace)
    assert torch.allclose(a.features, b.features, atol=1e-6)
    a.save(tmp_path / "t.pt")
    back = tr.LPSTraces.load(tmp_path / "t.pt")
    assert torch.equal(back.features, a.features) and back.meta["block_size"] == LB
    x, y, ok = a.batch(torch.tensor([0, 3]))
    n = (a.offsets[1:] - a.offsets[:-1])[[0, 3]]
    assert x.shape[:2] == ok.shape and ok.sum(dim=1).tolist() == n.tolist() and not (y & ~ok).any()


# -- LPS training pieces ------------------------------------------------------------------------------------


def test_trace_level_split_is_deterministic_and_disjoint():
    a = tr.split_traces(100)
    assert a == tr.split_traces(100, seed=42) and a != tr.split_traces(100, seed=1)
    assert [len(p) for p in a] == [80, 10, 10] and len(set(a[0]) | set(a[1]) | set(a[2])) == 100
    assert [len(p) for p in tr.split_traces(3)] == [1, 1, 1]


def test_weighted_bce_weights_negatives_twice_and_ignores_padding():
    logits = torch.tensor([[0.5, -1.0, float("-inf")]])
    labels = torch.tensor([[True, False, False]])
    valid = torch.tensor([[True, True, False]])
    want = (-math.log(torch.sigmoid(torch.tensor(0.5))) + 2 * -math.log(1 - torch.sigmoid(torch.tensor(-1.0)))) / 2
    assert math.isclose(float(tr.weighted_bce(logits, labels, valid)), float(want), rel_tol=1e-5)


def test_rates_match_a_brute_force_count():
    g = torch.Generator().manual_seed(0)
    p, y = torch.rand(500, generator=g), torch.rand(500, generator=g) < 0.6
    taus = torch.tensor([0.0, 0.3, 0.5, 0.97, 1.0])
    recall, fpr = tr.rates(p, y, taus)
    for k, t in enumerate(taus):
        assert math.isclose(float(recall[k]), float(((p > t) & y).sum() / y.sum()))
        assert math.isclose(float(fpr[k]), float(((p > t) & ~y).sum() / (~y).sum()))


def test_tau_psi_selection_hits_the_fp_budget():
    g = torch.Generator().manual_seed(0)
    neg = torch.rand(20000, generator=g) ** 4  # scores of negatives, mostly low
    pos = 1 - torch.rand(20000, generator=g) ** 3 * 0.5  # positives, mostly high
    p, y = torch.cat([pos, neg]), torch.cat([torch.ones(20000, dtype=torch.bool), torch.zeros(20000, dtype=torch.bool)])
    sel = tr.select_tau_psi(p, y, fpr_budget=0.01)
    assert sel["feasible"] and sel["fpr"] <= 0.01 and sel["in_band"]
    assert 0.8 <= sel["tau_psi"] <= 0.9999
    grid = torch.linspace(0.8, 0.9999, 250, dtype=torch.float64)
    recall, fpr = tr.rates(p, y, grid)
    assert sel["recall"] == pytest.approx(float(recall[fpr <= 0.01].max()))  # the best feasible recall
    hopeless = tr.select_tau_psi(torch.full((10,), 0.99999), torch.tensor([True, False] * 5))
    assert not hopeless["feasible"] and hopeless["tau_psi"] == pytest.approx(0.9999)


def synthetic_traces(n_traces=30, seed=0):
    """Records whose label is 1[κ > 0.6] (learnable from feature 0), 3-6 positions each."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for t in range(n_traces):
        for s in range(4):
            n = int(torch.randint(3, 7, (1,), generator=g))
            f = torch.rand(n, 5, generator=g)
            steps.append((t, s, f, f[:, 0] > 0.6))
    return tr.LPSTraces.from_steps(steps, {"synthetic": True})


@pytest.mark.filterwarnings("ignore:LPS validation FPR")
def test_train_lps_learns_a_separable_rule_and_reports_the_test_split(tmp_path):
    traces = synthetic_traces()
    router, tau, report = tr.train_lps(traces, tr.LPSTrainConfig(max_epochs=40, patience=40, batch_size=32, lr=3e-3,
                                                                 warmup_frac=0.0),
                                       LPSConfig(d=16, layers=1, heads=2, ffn=32, dropout=0.0))
    assert 0.8 <= tau <= 0.9999 and report["split"] == {"train": 96, "val": 12, "test": 12}
    assert report["test"]["recall"] > 0.3 and report["test"]["fpr"] <= 0.1
    assert report["val"]["fpr"] <= 0.01 and 1 <= report["best_epoch"] <= report["epochs"]
    tr.save_lps(router, tau, dllm(), tmp_path, report, {"block_size": LB})
    info = json.loads((tmp_path / "lps.json").read_text())
    assert info["tau_psi"] == tau and info["serving"] == {"block_size": LB} and info["metrics"]["test"]


def test_lps_early_stopping_and_refusals():
    traces = synthetic_traces()
    with pytest.warns(UserWarning, match="outside 1.0% ± 0.5 points"):  # 12 validation records: FPR 0 %
        _, _, report = tr.train_lps(traces, tr.LPSTrainConfig(max_epochs=50, patience=2, batch_size=64),
                                    LPSConfig(d=16, layers=1, heads=2, ffn=32))
    assert report["stopped"] == "early-stop" and report["epochs"] < 50
    with pytest.raises(UnmaskError, match="at least 3 traces"):
        tr.train_lps(synthetic_traces(n_traces=2))
    one_class = tr.LPSTraces.from_steps([(t, 0, torch.rand(3, 5), torch.ones(3, dtype=torch.bool)) for t in range(5)], {})
    with pytest.raises(UnmaskError, match="one label class"):
        tr.train_lps(one_class)


# -- CLI end to end on a tiny saved model ----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:LPS validation FPR")
def test_cli_trains_both_routers_and_generate_uses_them(tmp_path, capsys, stories):
    model = tiny_llama(vocab=512, seed=0, initializer_range=0.4)
    mask = add_mask_token(model)
    d = tmp_path / "tiny-dlm"
    model.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories.path / f, d / f)
    (d / "unmask_config.json").write_text(json.dumps({"kind": "masked-diffusion", "mask_token_id": mask,
                                                      "logit_shift": 1, "stop_token_ids": [2, 1]}))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"ids": list(range(20 + i, 40 + i))}) + "\n" for i in range(12)))
    code, out, err = run_cli(capsys, "train", "lbs", "--model", str(d), "--data", str(corpus), "--prompts", "6",
                             "--gen-length", "16", "--block-size", "4", "--responses", "threshold", "--epochs", "1")
    assert code == 0, err
    assert (d / "routers" / "lbs.json").is_file() and "params=" in out
    code, out, err = run_cli(capsys, "train", "lps", "--model", str(d), "--data", str(corpus), "--prompts", "6",
                             "--block-size", "4", "--l-min", "2", "--g-max", "2", "--max-epochs", "2",
                             "--traces-file", str(tmp_path / "traces.pt"))
    assert code == 0, err
    assert "tau_psi=" in out and (tmp_path / "traces.pt").is_file()
    code, out, err = run_cli(capsys, "generate", "Once", "-m", str(d), "-d", "early-bird", "-n", "8", "--json")
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    assert row["decoder"] == "early-bird" and row["lps"] is True
    code, out, err = run_cli(capsys, "train", "lbs", "--model", str(d))
    assert code == 2 and "--data" in err
