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
    from unmask.decode.verify.batch import for_layout

    bundle = tiny_bundle(tiny_llama(vocab=12, max_position_embeddings=40, initializer_range=0.2))
    prompt = [[1, 4, 5, 6, 4, 5]]
    ar = decode(bundle, prompt, decoder="ar", max_new_tokens=10)
    assert decode(bundle, prompt, decoder="ar", max_new_tokens=10, draft_source="lookup", draft_tokens=31).tokens == ar.tokens
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
