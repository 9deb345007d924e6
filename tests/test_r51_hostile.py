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
