"""Model-free draft sources in the verify batch (spec/draft_sources.md, issue 51): lookup and suffix
drafts verified by the model give AR's output exactly (greedy: token for token, every row as alone;
sampled: AR's distribution), alone on any causal model or beside the SBD block draft."""

from __future__ import annotations

import pytest
from conftest import one_line_error, tiny_bundle, tiny_llama, tiny_qwen3

import unmask
from unmask.decode import decode
from unmask.decode.verify import drafting, host_drafts
from unmask.decode.verify.drafting import Acceptance
from unmask.errors import UnmaskError
from unmask.models.mask_token import add_mask_token
from unmask.sampling import Sampling
from test_sbd_verify import _ar_distribution, _chi_square_p

FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}
# prompts that repeat themselves, so lookup finds matches; ragged lengths
PROMPTS = [[1, 4, 5, 6, 7, 4, 5, 6], [1, 3], [1, 7, 7, 7, 7, 7], [1, 5, 6, 2, 5, 6, 2, 5]]


def causal_bundle(arch="llama", vocab=12, seed=0):
    """A tiny random causal model whose greedy text repeats itself (a small vocabulary), so lookup drafts
    are accepted often enough to exercise multi-token commits (asserted where it matters)."""
    return tiny_bundle(FACTORIES[arch](vocab=vocab, seed=seed, initializer_range=0.2))


class Always:
    """A test drafter that always proposes ``limit`` ids: a fixed cycle, right or wrong (every accept
    and reject path of the verify step runs)."""

    def __init__(self, history, *_, **__):
        self.n = len(history)

    def extend(self, tokens):
        self.n += len(tokens)

    def propose(self, limit):
        return [2 + (self.n + i) % 3 for i in range(max(limit, 0))], 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("source", ["lookup", "suffix"])
def test_greedy_model_free_drafts_equal_ar_and_every_row_equals_it_alone(arch, source):
    bundle = causal_bundle(arch)
    ar = decode(bundle, PROMPTS, decoder="ar", max_new_tokens=40)
    out = decode(bundle, PROMPTS, decoder="ar", max_new_tokens=40, draft_source=source)
    assert out.tokens == ar.tokens
    assert sum(out.stats.nfe_per_row) < sum(ar.stats.nfe_per_row)  # drafts were accepted
    drafts = out.stats.extra["drafts"][source]
    assert 0 < drafts["accepted"] <= drafts["drafted"]
    for i, p in enumerate(PROMPTS):
        alone = decode(bundle, [p], decoder="ar", max_new_tokens=40, draft_source=source)
        assert alone.tokens[0] == out.tokens[i]
    # below CLOCK_ROWS rows each row sizes its own drafts: its forwards are its forwards alone
    few = decode(bundle, PROMPTS[:3], decoder="ar", max_new_tokens=40, draft_source=source)
    for i, p in enumerate(PROMPTS[:3]):
        alone = decode(bundle, [p], decoder="ar", max_new_tokens=40, draft_source=source)
        assert alone.tokens[0] == few.tokens[i] and alone.stats.nfe_per_row[0] == few.stats.nfe_per_row[i]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_any_draft_is_lossless_and_the_row_k_follows_it(monkeypatch, n):
    monkeypatch.setattr(drafting, "Lookup", Always)
    bundle = causal_bundle(seed=3)
    ar = decode(bundle, PROMPTS, decoder="ar", max_new_tokens=30)
    out = decode(bundle, PROMPTS, decoder="ar", max_new_tokens=30, draft_source="lookup", draft_tokens=n)
    assert out.tokens == ar.tokens
    windows = out.stats.extra["query_windows"]
    assert max(windows) <= n + 1  # a host row's window is its draft and the bonus, nothing more


def test_static_and_compiled_steps_equal_eager():
    bundle = causal_bundle(seed=1)
    eager = decode(bundle, PROMPTS[:3], decoder="ar", max_new_tokens=24, draft_source="lookup")
    static = decode(bundle, PROMPTS[:3], decoder="ar", max_new_tokens=24, draft_source="lookup", static=True)
    assert static.tokens == eager.tokens and static.stats.nfe_per_row == eager.stats.nfe_per_row


def test_stop_ids_strings_and_budgets_cut_like_ar():
    bundle = unmask.load("stories260K")
    prompts = [bundle.encode(t) for t in ("Once upon a time", "Tom and Sam were friends. Tom")]
    for kw in ({"max_new_tokens": 1}, {"max_new_tokens": 57}, {"max_new_tokens": 80, "stop_strings": [" the"]}):
        ar = decode(bundle, prompts, decoder="ar", **kw)
        for source in ("lookup", "suffix"):
            out = decode(bundle, prompts, decoder="ar", draft_source=source, **kw)
            assert out.tokens == ar.tokens and out.stats.stops_per_row == ar.stats.stops_per_row, (kw, source)


def test_shipped_models_drafts_equal_ar_and_beside_the_block_draft():
    from unmask.eval.story_openings import STORY_OPENINGS

    sbd = unmask.load("stories260K-sbd")
    prompts = [sbd.encode(t) for t in list(STORY_OPENINGS)[:6]]
    ar = decode(sbd, prompts, decoder="ar", max_new_tokens=96)
    block = decode(sbd, prompts, decoder="sbd", max_new_tokens=96)
    assert block.tokens == ar.tokens
    for source in ("lookup", "suffix", "block+lookup", "block+suffix"):
        out = decode(sbd, prompts, decoder="sbd", max_new_tokens=96, draft_source=source)
        assert out.tokens == ar.tokens, source
        assert out.stats.extra["drafts"], source
    both = decode(sbd, prompts, decoder="sbd", max_new_tokens=96, draft_source="block+lookup")
    assert set(both.stats.extra["drafts"]) == {"block", "lookup"}  # both sources drafted


@pytest.fixture(scope="module")
def sampling_case():
    model = tiny_llama(vocab=6, seed=5, attn_implementation="eager", initializer_range=0.2)
    bundle = tiny_bundle(model, kind="sbd", mask_token_id=add_mask_token(model))
    sampling = Sampling(temperature=1.0, top_k=5, seed=11)
    prompt = [1, 4, 3]
    return bundle, prompt, sampling, _ar_distribution(bundle, prompt, 3, sampling)


def _counts(bundle, prompt, sampling, monkeypatch, n=12_000):
    # each row sizes its own drafts: measured step seconds (StepClock) must not decide whether this test drafts,
    # and a row's only useful draft is at its join (a draft past its last new token is never placed)
    monkeypatch.setattr(host_drafts, "CLOCK_ROWS", n + 1)
    out = decode(bundle, [prompt] * n, decoder="ar", max_new_tokens=3, sampling=sampling, draft_source="lookup",
                 draft_tokens=2)
    counts: dict = {}
    for row in out.tokens:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, out


def test_sampled_host_drafts_have_the_ar_distribution(sampling_case, monkeypatch):
    monkeypatch.setattr(drafting, "Lookup", Always)
    bundle, prompt, sampling, probs = sampling_case
    counts, out = _counts(bundle, prompt, sampling, monkeypatch)
    drafts = out.stats.extra["drafts"]["lookup"]
    assert drafts["accepted"] > 1000 and drafts["drafted"] - drafts["accepted"] > 1000  # both paths ran
    assert _chi_square_p(counts, probs, 12_000) > 1e-3


def test_a_wrong_proposal_fails_the_distribution_test(sampling_case, monkeypatch):
    """Control: a draft accepted as if it were drawn from a uniform q (not its one-hot) is not AR's."""
    monkeypatch.setattr(drafting, "Lookup", Always)
    real = host_drafts.place_drafts

    def uniform_q(batch, placing):
        real(batch, placing)
        if batch.q is not None:
            batch.q.fill_(1.0 / batch.q.shape[-1])

    monkeypatch.setattr(host_drafts, "place_drafts", uniform_q)
    bundle, prompt, sampling, probs = sampling_case
    counts, _ = _counts(bundle, prompt, sampling, monkeypatch)
    assert _chi_square_p(counts, probs, 12_000) < 1e-3


def test_acceptance_sizes_drafts_by_expected_tokens_per_cost():
    acc = Acceptance(prior=0.9, weight=10)
    assert acc.best_length(8, cost=0.1) == 8  # a good record drafts all it has
    assert acc.best_length(8, cost=0.0) == 8 and acc.best_length(0, cost=0.1) == 0
    bad = Acceptance(prior=0.05, weight=10)
    assert bad.best_length(8, cost=0.1) == 0  # a poor record: a plain K = 1 step
    for _ in range(20):
        bad.update(4, 4)  # every draft accepted: the record recovers
    assert bad.best_length(8, cost=0.1) >= 4
    assert Acceptance(prior=0.5, weight=1).expected(3) == pytest.approx(0.5 + 0.25 + 0.125)


@pytest.mark.parametrize("options, match", [
    ({"draft_source": "block"}, "unknown draft source"),
    ({"draft_source": "lookup", "draft_tokens": 0}, "--draft-tokens"),
    ({"draft_source": "lookup", "draft_tokens": 99}, "--draft-tokens"),
    ({"draft_tokens": 4}, "add --draft-source"),
])
def test_bad_draft_options_are_refused(options, match):
    with pytest.raises(UnmaskError, match=match):
        decode(causal_bundle(), [[1, 2]], decoder="ar", max_new_tokens=4, **options)


def test_sbd_host_source_refuses_block_options(capsys):
    one_line_error(capsys, "generate", "-m", "stories260K-sbd", "-d", "sbd", "--draft-source", "lookup",
                   "--block-size", "4", "Once", match="--draft-tokens")
    one_line_error(capsys, "generate", "-m", "stories260K-sbd", "-d", "sbd", "--draft-source", "lookup",
                   "--no-verify", "Once", match="--draft-source")


def test_cli_runs_a_causal_model_with_lookup(capsys):
    from conftest import run_cli

    code, out, err = run_cli(capsys, "generate", "-m", "stories260K", "-d", "ar", "--draft-source", "lookup",
                             "-n", "40", "--json", "Once upon a time")
    assert code == 0, err
    code2, out2, _ = run_cli(capsys, "generate", "-m", "stories260K", "-d", "ar", "-n", "40", "--json",
                             "Once upon a time")
    import json

    got, want = json.loads(out), json.loads(out2)
    assert got["texts"] == want["texts"] if "texts" in got else got == want or got["text"] == want["text"]
