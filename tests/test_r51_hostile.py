"""Hostile review of the model-free draft sources (issue 51): regressions found by trying to break
``draft_source`` / ``draft_tokens`` through the Python API, the CLI and the server."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import unmask
from unmask.serve.app import create_app


@pytest.fixture(scope="module")
def sbd_bundle():
    return unmask.load("stories260K-sbd")


@pytest.mark.parametrize("extra", [{"block_size": 4}, {"draft": "quadratic"}, {"queries": 6}])
def test_server_refuses_block_knobs_with_a_model_free_source_as_generate_does(sbd_bundle, extra):
    # generate refuses draft_source=lookup with block_size/draft/queries (they size a block draft that
    # never runs); the server silently ran the lookup drafts and dropped the request's knob
    with pytest.raises(unmask.UnmaskError, match="do not apply"):
        unmask.generate("Once", sbd_bundle, decoder="sbd", draft_source="lookup", max_new_tokens=4, **extra)
    with TestClient(create_app(sbd_bundle, max_batch_size=2)) as c:
        r = c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4, "decoder": "sbd",
                                            "draft_source": "lookup", **extra})
    assert r.status_code == 400, r.text
    assert "do not apply" in r.json()["error"]["message"]


def test_model_free_drafts_fit_a_small_context_and_name_draft_tokens_when_they_cannot():
    # a host step is K = draft_tokens + 1 queries, no prefill group: the block layouts' 2K rule refused
    # draft_tokens 20 on a 40-position model, told the user to lower --block-size (refused with lookup),
    # and the server's host batch (K 32) could not be built there, failing every lookup/suffix request
    from conftest import tiny_bundle, tiny_llama

    from unmask.decode import decode
    from unmask.decode.verify.serving import for_layout

    bundle = tiny_bundle(tiny_llama(vocab=12, max_position_embeddings=40, initializer_range=0.2))
    prompt = [[1, 4, 5, 6, 4, 5]]
    ar = decode(bundle, prompt, decoder="ar", max_new_tokens=10)
    out = decode(bundle, prompt, decoder="ar", max_new_tokens=10, draft_source="lookup", draft_tokens=31)
    assert out.tokens == ar.tokens
    for_layout(bundle, "host", capacity=2)
    small = tiny_bundle(tiny_llama(vocab=12, max_position_embeddings=16, initializer_range=0.2))
    with pytest.raises(unmask.UnmaskError, match="draft-tokens"):
        decode(small, prompt, decoder="ar", max_new_tokens=4, draft_source="lookup", draft_tokens=20)
    for_layout(small, "host", capacity=2)  # the server's batch drafts at most what the window holds


@pytest.mark.parametrize("source", ["block", "block+lookup", "block+suffix"])
def test_a_block_draft_source_asks_for_sbd_where_the_default_decoder_would_be_ar(sbd_bundle, monkeypatch, source):
    # where lossless SBD is expected slower than AR (the SmolLM2 adapter on a CPU), the default decoder
    # is ar; a block draft source, which only sbd takes, then failed with "unknown draft source
    # 'block+lookup' for decoder 'ar'", a decoder the user never named
    from unmask.decode import choice

    monkeypatch.setattr(choice, "choose", lambda tpf, cost: "ar")
    assert choice.default_for(sbd_bundle, {}).decoder == "ar"
    assert choice.default_for(sbd_bundle, {"draft_source": "lookup"}).decoder == "ar"  # ar takes it
    assert choice.default_for(sbd_bundle, {"draft_source": source}).decoder == "sbd"
    out = unmask.generate("Once", sbd_bundle, draft_source=source, max_new_tokens=8)
    assert out.texts == unmask.generate("Once", sbd_bundle, decoder="ar", max_new_tokens=8).texts


def test_draft_tokens_help_states_the_default_beside_the_block_draft():
    # --help said "default 8" for every source; beside the block draft the default is the block's K - 1
    from unmask.decode.blocks.sbd import SBDOptions
    from unmask.decode.verify.drafting import DEFAULT_DRAFT_TOKENS, DraftKnobs

    assert SBDOptions(draft_source="lookup").host_drafts("cpu").tokens == DEFAULT_DRAFT_TOKENS
    assert SBDOptions(draft_source="block+lookup").host_drafts("cpu", 16).tokens == 15
    help_text = next(k.help for k in DraftKnobs.knobs() if k.name == "draft_tokens")
    assert "K - 1" in help_text and "block+" in help_text


@pytest.mark.parametrize("source", ["lookup", "block+lookup"])
def test_no_draft_token_past_the_row_s_last_new_token(monkeypatch, source):
    # a step commits at most max_new_tokens - committed tokens, its bonus included, so draft tokens past
    # that can never be kept; a row near its end still drafted a full window (queries for nothing, and
    # on the host layout a wider window for every row of the batch)
    from test_draft_sources import Always

    from unmask.decode import decode
    from unmask.decode.verify import drafting, host_drafts

    monkeypatch.setattr(drafting, "Lookup", Always)
    bundle = unmask.load("stories260K-sbd" if source.startswith("block") else "stories260K")
    prompts = [bundle.encode("Once upon a time"), bundle.encode("Tom had a red ball. Tom")]
    seen = []
    real = host_drafts.place_drafts

    def spy(batch, placing):
        for row, d in placing:
            if d is not None:
                seen.append(len(d) - (row.job.max_new_tokens - len(row.committed) - 1))
        real(batch, placing)

    monkeypatch.setattr(host_drafts, "place_drafts", spy)
    for n in (2, 3, 5, 9, 17):
        out = decode(bundle, prompts, decoder="sbd" if source.startswith("block") else "ar", max_new_tokens=n,
                     draft_source=source)
        assert out.tokens == decode(bundle, prompts, decoder="ar", max_new_tokens=n).tokens
    assert seen and max(seen) <= 0, seen


def test_limits_count_a_block_draft_source_as_lossless_on_a_lossy_default_checkpoint(sbd_bundle, monkeypatch):
    # a draft source makes an sbd request lossless whatever the checkpoint's default; runs_lossless (the
    # server's limits and load sizer) ignored it, so --max-query-tokens counted a block+lookup request as
    # a lossy block of K queries instead of its draft layout's
    from unmask.decode.blocks.sbd import SBDOptions, runs_lossless
    from unmask.serve.limits import query_tokens

    monkeypatch.setitem(sbd_bundle.meta["decode_defaults"], "verify", False)
    options = {"draft_source": "block+lookup"}
    assert SBDOptions(**options).lossless(sbd_bundle) and runs_lossless(sbd_bundle, options)
    lossless = query_tokens(sbd_bundle, "sbd", {**options, "verify": True}, 16)[0]
    assert query_tokens(sbd_bundle, "sbd", options, 16)[0] == lossless


def test_seeded_sampled_drafts_do_not_depend_on_measured_step_seconds(monkeypatch):
    # from CLOCK_ROWS rows on, the host batch cuts drafts by measured step seconds (StepClock); a sampled
    # row's draft decides which random draws it makes, so a seeded sampled decode gave another text on a
    # faster or busier machine, and a row in a batch another text than alone
    from unmask.decode import decode
    from unmask.decode.verify import host_drafts
    from unmask.sampling import Sampling

    bundle = unmask.load("stories260K")
    texts = ["Once upon a time", "Tom had a red ball. Tom had a red ball. Tom", "Lily and Sam went to the park",
             "The cat sat on the mat. The cat", "Lily Lily Lily", "One day"]
    prompts = [bundle.encode(t) for t in texts]
    sampling = Sampling(temperature=0.8, seed=7)
    record = host_drafts.StepClock.record

    def run(seconds):  # seconds(Q): a machine's step time at window Q (deterministic, not measured)
        monkeypatch.setattr(host_drafts.StepClock, "record", lambda self, rows, Q, _: record(self, rows, Q, seconds(Q)))
        return decode(bundle, prompts, decoder="ar", max_new_tokens=60, draft_source="lookup", sampling=sampling)

    wide, narrow = run(lambda Q: 1.0), run(lambda Q: float(Q))  # queries free vs. each as dear as a step
    assert wide.tokens == narrow.tokens
    alone = decode(bundle, prompts[:1], decoder="ar", max_new_tokens=60, draft_source="lookup", sampling=sampling)
    assert alone.tokens[0] == wide.tokens[0]
