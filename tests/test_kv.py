"""unmask.decode.engine.kv: the static cache with a moving pointer gives the dynamic cache's logits for
the same sequence of forwards and crops (STYLE.md 14), and refuses to overflow."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3

from unmask.decode.engine.kv import DynamicKV, StaticKV, make_kv
from unmask.errors import UnmaskError
from unmask.masks import as_4d, block_causal_mask


def _script(kv, model, gen):
    """Prefill 6 tokens, then denoise-like steps: a 4-token block forwarded twice (cropped after
    the first), a block kept, a crop of 2; returns every forward's logits."""
    B = 2
    out = []
    ids = torch.randint(3, 60, (B, 6), generator=gen)
    pos = torch.arange(6).expand(B, 6)
    out.append(kv.forward(ids, pos, as_4d(block_causal_mask(6, 2), B), compiled=False))
    for keep in (False, True, True):
        past = kv.length
        blk = torch.randint(3, 60, (B, 4), generator=gen)
        bpos = past + torch.arange(4).expand(B, 4)
        m = torch.ones((B, 1, 4, past + 4), dtype=torch.bool)
        m[:, :, :, past:] = torch.ones(4, 4, dtype=torch.bool).tril()
        m[1, :, :, 0] = False  # row 1's first key is padding
        out.append(kv.forward(blk, bpos, m, logits_to_keep=3))
        if not keep:
            kv.crop(4)
    kv.crop(2)
    assert kv.length == 6 + 4 + 4 - 2
    past = kv.length
    m = torch.ones((B, 1, 1, past + 1), dtype=torch.bool)
    out.append(kv.forward(torch.full((B, 1), 7), torch.full((B, 1), past), m))
    return out


@pytest.mark.parametrize("factory,attn", [(tiny_llama, "sdpa"), (tiny_qwen3, "eager")])
def test_static_kv_gives_the_dynamic_logits(factory, attn):
    model = factory(attn_implementation=attn, initializer_range=0.2)
    dyn = _script(DynamicKV(model), model, torch.Generator().manual_seed(0))
    kv = StaticKV(model, 2, 20)
    sta = _script(kv, model, torch.Generator().manual_seed(0))
    for a, b in zip(dyn, sta):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert kv.capacity == 128 and kv.static and not DynamicKV(model).static


def test_static_kv_refuses_to_overflow_and_reset_starts_over():
    model = tiny_llama()
    kv = make_kv(model, batch=1, capacity=4, static=True)
    kv.forward(torch.ones((1, 100), dtype=torch.long), torch.arange(100)[None], None, compiled=False)
    with pytest.raises(UnmaskError, match="overflow"):
        kv.forward(torch.ones((1, 29), dtype=torch.long), torch.arange(29)[None], None)
    kv.reset()
    assert kv.length == 0
    assert isinstance(make_kv(model, batch=1, capacity=4), DynamicKV)


def test_the_first_write_of_a_compiled_static_kv_runs_eagerly():
    # Issue 48 item 1: a compiled step traced while the StaticCache is unallocated holds its
    # allocation (fresh zeros on every call) and, keeping only tensor guards, served every later
    # cache of its shape: a block decoder after a prompt shorter than one block decoded garbage.
    kv = StaticKV(tiny_llama(), 2, 16, compile=True)
    ran = []
    kv._step = lambda *args: (ran.append(args[-1].layers[0].is_initialized), kv._eager(*args))[1]
    inp, pos = torch.randint(3, 60, (2, 4)), torch.arange(4).expand(2, 4)
    first = kv.forward(inp, pos, None)  # the first write: a prompt with nothing to prefill
    assert ran == [] and kv.allocated
    kv.forward(inp, pos + 4, None)
    assert ran == [True]  # the compiled step sees only an allocated cache
    eager = StaticKV(tiny_llama(), 2, 16)
    torch.testing.assert_close(first, eager.forward(inp, pos, None))
