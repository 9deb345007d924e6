"""LPS trace collection labels each record from its own row (spec/early_bird.md §4.3): Early-Bird's
running batch drops rows as they finish, so its tensor rows are slots, not prompt numbers. With
prompts of different lengths that finish at different steps, every trace collected in one batch
equals the trace of its prompt collected alone."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_bundle, tiny_llama

from unmask.decode import DECODERS
from unmask.models.mask_token import add_mask_token
from unmask.routers import LBSConfig, LBSRouter
from unmask.train import routers as tr

L, LB = 16, 4
# τ = 0.5 on these random weights: the rows finish after 12 to 16 forwards, not all at once
SETTINGS = dict(block_size=LB, l_min=2, g_max=2, tau=0.5)
PROMPTS = [[1, 5, 9], [1, 7], [1, 3, 4, 5, 6], [1, 8, 8], [1, 11], [1, 12, 13], [1, 20], [1, 21, 22]]


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(vocab=64, seed=0, initializer_range=0.4)
    mask = add_mask_token(model)
    bundle = tiny_bundle(model, kind="masked-diffusion", mask_token_id=mask, stop_token_ids=(2,))
    bundle.logit_shift = 1
    torch.manual_seed(0)
    lbs = LBSRouter(LBSConfig(gen_length=L, d_base=32, vocab_size=65)).eval()
    return bundle, lbs


def trace_of(traces: tr.LPSTraces, k: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(step, features (n, 5), labels (n,)) of trace k's records, in step order."""
    recs = sorted(traces.records_of([k]).tolist(), key=lambda j: int(traces.step[j]))
    o = traces.offsets
    return [(int(traces.step[j]), traces.features[o[j]:o[j + 1]], traces.labels[o[j]:o[j + 1]]) for j in recs]


def test_the_rows_finish_at_different_steps(setup):
    bundle, lbs = setup
    sizes = []
    out = DECODERS["early-bird"].decode(bundle, PROMPTS, max_new_tokens=L, gen_length=L, stop_token_ids=(2,), lps=False,
                            lbs_router=lbs, on_forward=lambda s: sizes.append(len(s["ids"])), **SETTINGS)
    assert len(set(out.stats.nfe_per_row)) > 1 and sizes[-1] < len(PROMPTS)  # the running batch shrank


@pytest.mark.parametrize("batch_size, replay, cache", [(3, False, "none"), (8, False, "none"), (3, True, "none"),
                                                       (8, True, "none"), (8, False, "dual")])
def test_each_trace_is_its_own_prompts_trace(setup, batch_size, replay, cache):
    bundle, lbs = setup
    kw = dict(replay=replay, cache=cache, **SETTINGS)
    batched = tr.collect_lps_traces(bundle, lbs, PROMPTS, batch_size=batch_size, **kw)
    assert batched.n_traces == len(PROMPTS)
    for k, prompt in enumerate(PROMPTS):
        alone = tr.collect_lps_traces(bundle, lbs, [prompt], batch_size=1, **kw)
        got, want = trace_of(batched, k), trace_of(alone, 0)
        assert [s for s, _, _ in got] == [s for s, _, _ in want] == list(range(len(want)))
        for (_, f, y), (_, f1, y1) in zip(got, want):
            assert torch.equal(y, y1)
            assert torch.allclose(f, f1, atol=1e-5)

