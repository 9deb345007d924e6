"""Every decoder asserts an NFE ceiling (issue 15 item 7): a step that writes the mask id back
commits nothing, and without the ceiling the decode loop would never end."""

from __future__ import annotations

import pytest
import torch

import unmask
from unmask.decode.blocks import batch as blocks
from unmask.decode.dllm import diffusion_batch as diffusion_engine
from unmask.decode.dllm import early_bird_batch as early_bird_engine
from unmask.decode.multiblock import batch as multiblock_engine
from unmask.errors import UnmaskError
from unmask.policies import TokenStats


class Runaway(Exception):
    pass


def _guard(counter):
    counter[0] += 1
    if counter[0] > 2000:  # the old code loops forever; fail instead of hanging
        raise Runaway


def _mask_commits(module, name, mask_id, counter):
    real = getattr(module, name)

    def fake(*args, **kwargs):
        _guard(counter)
        chosen, tokens = real(*args, **kwargs)
        return chosen, torch.full_like(tokens, mask_id)

    return fake


CASES = {  # decoder -> (module, function to corrupt, model)
    "diffusion": (diffusion_engine, "commit", "stories260K-dlm"),  # the running batch's step
    "sbd": (blocks, "commit", "stories260K-sbd"),
    "block": (blocks, "commit", "stories260K-bd"),  # the one running batch of block and lossy sbd
}


@pytest.mark.parametrize("decoder", list(CASES))
def test_a_step_that_commits_the_mask_id_hits_the_ceiling(monkeypatch, decoder):
    module, name, model = CASES[decoder]
    bundle = unmask.load(model)
    counter = [0]
    monkeypatch.setattr(module, name, _mask_commits(module, name, bundle.mask_token_id, counter))
    with pytest.raises(UnmaskError, match=f"the {decoder} decoder ran .* above its ceiling"):
        # sbd: the lossy path (lossless SBD commits the verified bonus token every forward, >= 1 by construction)
        unmask.generate(["Once upon a time"], bundle, decoder, max_new_tokens=16,
                        **({"verify": False} if decoder == "sbd" else {}))


def test_early_bird_hits_the_ceiling(monkeypatch):
    bundle = unmask.load("stories260K-dlm")
    real, counter = early_bird_engine.token_stats, [0]  # the running batch's step

    def stats(logits, **kw):
        _guard(counter)
        s = real(logits, **kw)
        return TokenStats(torch.full_like(s.top1, bundle.mask_token_id), *s[1:])

    monkeypatch.setattr(early_bird_engine, "token_stats", stats)
    with pytest.raises(UnmaskError, match="the early-bird decoder ran .* above its ceiling of 512"):
        unmask.generate(["Once upon a time"], bundle, "early-bird", max_new_tokens=16)


def test_multiblock_hits_the_ceiling(monkeypatch):
    bundle = unmask.load("stories260K-mbd")
    real, counter = multiblock_engine.candidates, [0]

    def cands(*args):
        _guard(counter)
        tokens, kappa = real(*args)
        return torch.full_like(tokens, bundle.mask_token_id), kappa

    monkeypatch.setattr(multiblock_engine, "candidates", cands)  # the Block Buffer's running batch calls it
    with pytest.raises(UnmaskError, match="the multiblock decoder ran .* above its ceiling"):
        unmask.generate(["Once upon a time"], bundle, "multiblock", max_new_tokens=16)


@pytest.mark.parametrize("decoder, model", [("diffusion", "stories260K-dlm"), ("sbd", "stories260K-sbd"),
                                            ("block", "stories260K-bd"), ("multiblock", "stories260K-mbd"),
                                            ("early-bird", "stories260K-dlm")])
def test_normal_decodes_stay_under_the_ceiling(decoder, model):
    out = unmask.generate(["Once upon a time"], model, decoder, max_new_tokens=16)
    assert 1 <= out.stats.nfe <= 16 + 16
