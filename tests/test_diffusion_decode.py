"""Diffusion decoder (spec/diffusion.md §2–§4, §6–§9): bidirectional forward and logit shift,
commit rules against an independent uncached forward, LLaDA schedule, caches, batching, EOS,
bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_bundle, tiny_llama, tiny_qwen3

import unmask
from unmask.compat import forward, new_cache
from unmask.decode import DECODERS, spec_for
from unmask.decode.dllm import diffusion
from unmask.decode.dllm.canvas import early_stop
from unmask.decode.dllm.cache import SlotCanvas
from unmask.errors import UnmaskError
from unmask.models.adapters import bidirectional_forward, realign
from unmask.models.mask_token import add_mask_token
from unmask.sampling import Sampling

FACTORIES = {"llama": tiny_llama, "qwen3": tiny_qwen3}


@pytest.fixture(autouse=True)
def _inference():
    # The decoder returns inference tensors; reference forwards on them must not track gradients.
    with torch.inference_mode():
        yield


def dllm(shift=0, *, arch="llama", impl="sdpa", layers=2, seed=0, init=0.4, stops=()):
    """A tiny LLaDA-style (shift 0) or Dream-style (shift 1) stand-in: a random causal-LM class run
    bidirectionally, peaked (init 0.4) so that argmax is not decided by float noise."""
    model = FACTORIES[arch](vocab=64, seed=seed, attn_implementation=impl, num_hidden_layers=layers,
                            initializer_range=init)
    mask_id = add_mask_token(model)
    bundle = tiny_bundle(model, kind="masked-diffusion", mask_token_id=mask_id, stop_token_ids=stops)
    bundle.logit_shift = shift
    return bundle


def reference_logits(bundle, canvas: torch.Tensor, n_prompt: int, start: int, size: int) -> torch.Tensor:
    """Independent uncached bidirectional forward of one unpadded row (1, T): logits (size, V) scoring
    generated positions start..start+size-1, realigned by hand (shift 1: output at i-1 scores i)."""
    T = canvas.shape[1]
    out = forward(bundle.model, canvas, position_ids=torch.arange(T)[None], is_causal=False)[0]  # (T, V)
    first = n_prompt + start - bundle.logit_shift
    out = out[first: first + size].clone()
    out[:, bundle.mask_token_id] = float("-inf")
    return out


# -- independent statements of each rule (diffusion.md §3, §6, §7), on one row ------------------


def _q(logits):
    return torch.softmax(logits.double(), dim=-1)


def rule_threshold(logits, masked, tau):
    kappa = _q(logits).max(-1).values
    cand = [i for i in range(len(masked)) if masked[i]]
    best = max(cand, key=lambda i: kappa[i])
    return {i for i in cand if kappa[i] >= tau} | {best}


def rule_factor(logits, masked, f):
    kappa = _q(logits).max(-1).values
    order = sorted((i for i in range(len(masked)) if masked[i]), key=lambda i: -kappa[i])
    n = 1
    while n < len(order) and (n + 2) * (1 - kappa[order[n]]) <= f:
        n += 1
    return set(order[:n])


def rule_top_k(logits, masked, k):
    kappa = _q(logits).max(-1).values
    order = sorted((i for i in range(len(masked)) if masked[i]), key=lambda i: -kappa[i])
    return set(order[:k])


def _entropy(logits):
    q = _q(logits)
    return -(q * q.clamp_min(1e-300).log()).sum(-1)


def rule_eb(logits, masked, gamma, proxy):
    H, q = _entropy(logits), _q(logits)
    key = {"confidence": lambda i: -q[i].max(), "entropy": lambda i: H[i]}[proxy]
    order = sorted((i for i in range(len(masked)) if masked[i]), key=key)
    n = 1
    while n < len(order) and sum(H[j] for j in order[: n + 1]) - max(H[j] for j in order[: n + 1]) <= gamma:
        n += 1
    return set(order[:n])


def rule_entropy_threshold(logits, masked, eta):
    H = _entropy(logits)
    cand = [i for i in range(len(masked)) if masked[i]]
    picked = {i for i in cand if H[i] <= eta}
    return picked or {min(cand, key=lambda i: H[i])}


POLICY_CASES = {
    "threshold": (dict(policy="threshold", tau=0.5), lambda lg, m, s: rule_threshold(lg, m, 0.5)),
    "factor": (dict(policy="factor", factor=2.0), lambda lg, m, s: rule_factor(lg, m, 2.0)),
    "top-k": (dict(policy="top-k", tokens_per_step=3), lambda lg, m, s: rule_top_k(lg, m, 3)),
    "confidence-bound": (dict(policy="confidence-bound", gamma=2.0), lambda lg, m, s: rule_eb(lg, m, 2.0, "confidence")),
    "entropy-bound": (dict(policy="entropy-bound", gamma=2.0), lambda lg, m, s: rule_eb(lg, m, 2.0, "entropy")),
    "entropy-threshold": (dict(policy="entropy-threshold", eta=1.5), lambda lg, m, s: rule_entropy_threshold(lg, m, 1.5)),
}


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("name", list(POLICY_CASES))
def test_each_policy_commits_what_its_rule_says(name, shift):
    bundle = dllm(shift)
    options, rule = POLICY_CASES[name]
    prompt = [1, 5, 9, 3]
    seen = []
    out = DECODERS["diffusion"].decode(bundle, [prompt], max_new_tokens=16, block_size=8, on_forward=seen.append, **options)
    counts = out.stats.extra["row_extra"][0]["commits"]
    assert len(seen) == out.stats.nfe == len(counts) and sum(counts) == 16
    assert max(counts) > 1, "parameters chosen so the rule commits several tokens in some step"
    for state in seen:
        want_logits = reference_logits(bundle, state["canvas"], len(prompt), state["start"], 8)
        torch.testing.assert_close(state["logits"][0, :, :-1], want_logits[:, :-1], atol=1e-4, rtol=1e-4)
        masked = state["masked"][0].tolist()
        got = set(torch.nonzero(state["chosen"][0]).flatten().tolist())
        assert got == rule(want_logits, masked, state["step"])
        assert state["tokens"][0][list(got)].tolist() == want_logits[list(got)].argmax(-1).tolist()


@pytest.mark.parametrize("shift", [0, 1])
def test_forward_is_bidirectional_and_shift_realigns(shift):
    bundle = dllm(shift)
    ids = torch.tensor([[1, 5, 9, 3, 64, 64, 64]])
    pos = torch.arange(7)[None]
    raw = bidirectional_forward(bundle, ids, position_ids=pos, key_valid=torch.ones(1, 7, dtype=torch.bool))
    changed = ids.clone()
    changed[0, 6] = 7
    raw2 = bidirectional_forward(bundle, changed, position_ids=pos, key_valid=torch.ones(1, 7, dtype=torch.bool))
    assert (raw[0, 0] - raw2[0, 0]).abs().max() > 1e-3  # position 0 sees the last token: not causal
    # The decoder's block logits at generated position j equal the raw output at P + j - shift.
    seen = []
    DECODERS["diffusion"].decode(bundle, [[1, 5, 9, 3]], max_new_tokens=4, block_size=4, policy="top-k", steps=4,
                     on_forward=seen.append)
    first = seen[0]
    full = bidirectional_forward(bundle, first["canvas"], position_ids=torch.arange(8)[None],
                                 key_valid=torch.ones(1, 8, dtype=torch.bool))  # (1, 8, V)
    for j in range(4):
        torch.testing.assert_close(first["logits"][0, j, :-1], full[0, 4 + j - shift, :-1])
    torch.testing.assert_close(realign(full, shift)[:, 4:, :-1], first["logits"][:, :, :-1])


def test_llada_quota_schedule():
    quota = [diffusion.llada_quota(torch.tensor([32, 7, 3]), 5, s).tolist() for s in range(5)]
    assert [q[0] for q in quota] == [7, 7, 6, 6, 6]  # base 6, rem 2
    assert [q[1] for q in quota] == [2, 2, 1, 1, 1]
    assert [q[2] for q in quota] == [1, 1, 1, 0, 0]  # more steps than masks: zeros at the end
    bundle = dllm()
    out = DECODERS["diffusion"].decode(bundle, [[1, 5, 9]], max_new_tokens=16, block_size=8, steps=6)  # 3 steps per block
    assert out.stats.extra["row_extra"][0]["commits"] == [3, 3, 2, 3, 3, 2]
    assert out.stats.nfe == 6 and out.stats.extra["policy"] == "top-k"


def test_top_k_with_steps_equal_to_gen_length_commits_one_per_step():
    bundle = dllm()
    out = DECODERS["diffusion"].decode(bundle, [[1, 5, 9], [1, 2]], max_new_tokens=16, block_size=8, policy="top-k", steps=16)
    assert out.stats.nfe == 16 and out.stats.nfe_per_row == [16, 16]
    assert out.stats.extra["accepts"] == {1: 32}
    assert all(r["commits"] == [1] * 16 for r in out.stats.extra["row_extra"])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("shift", [0, 1])
def test_cache_refreshed_every_step_equals_no_cache(cache, shift):
    bundle = dllm(shift)
    prompts = [[1, 5, 9, 3], [1, 7]]
    kw = dict(max_new_tokens=24, block_size=8, policy="threshold", tau=0.5)
    plain = DECODERS["diffusion"].decode(bundle, prompts, cache="none", **kw)
    fresh = DECODERS["diffusion"].decode(bundle, prompts, cache=cache, refresh_every=1, **kw)
    assert fresh.tokens == plain.tokens and fresh.stats.nfe_per_row == plain.stats.nfe_per_row
    assert fresh.stats.extra["cache"] == cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("shift", [0, 1])
def test_caches_are_exact_on_a_one_layer_model(arch, cache, shift):
    """With one layer the kept K/V depend on their own tokens only, so the approximation vanishes:
    every cached step's logits equal the uncached forward's (checks positions, masks, layout)."""
    bundle = dllm(shift, arch=arch, layers=1)
    prompts = [[1, 5, 9, 3], [1, 7]]
    kw = dict(max_new_tokens=16, block_size=8, policy="top-k", tokens_per_step=2)
    ref, got = [], []
    plain = DECODERS["diffusion"].decode(bundle, prompts, cache="none", on_forward=ref.append, **kw)
    cached = DECODERS["diffusion"].decode(bundle, prompts, cache=cache, on_forward=got.append, **kw)
    assert cached.tokens == plain.tokens
    assert sum(not s["refresh"] for s in got) == 6  # 2 blocks x (4 steps - 1 refresh)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b["logits"][..., :-1], a["logits"][..., :-1], atol=1e-4, rtol=1e-4)


def test_caches_are_approximate_on_deeper_models():
    bundle = dllm(0, layers=2)
    kw = dict(max_new_tokens=16, block_size=8, policy="top-k", tokens_per_step=2)
    for cache in ("prefix", "dual"):
        seen = []
        DECODERS["diffusion"].decode(bundle, [[1, 5, 9, 3]], cache=cache, on_forward=seen.append, **kw)
        cached_steps = [s for s in seen if not s["refresh"]]
        diffs = [(s["logits"][0, :, :-1] - reference_logits(bundle, s["canvas"], 4, s["start"], 8)[:, :-1]).abs().max()
                 for s in cached_steps]
        assert max(diffs) > 1e-3  # stale prefix (and suffix) K/V
        refreshes = [s for s in seen if s["refresh"]]
        for s in refreshes:  # a refresh is a full forward: exact
            want = reference_logits(bundle, s["canvas"], 4, s["start"], 8)[:, :-1]
            torch.testing.assert_close(s["logits"][0, :, :-1], want, atol=1e-4, rtol=1e-4)


def test_dual_cache_holds_prefix_and_suffix_kv_of_the_refresh():
    """A dual refresh keeps the K/V of every canvas column, valid outside the window [w0, w1): what
    stays equals the natural-order forward's K/V; a window step leaves the kept K/V as they were."""
    bundle = dllm(0, impl="eager")
    T, w0, w1 = 12, 4, 8
    canvas = SlotCanvas(bundle, "dual", 1, T, w1 - w0)
    canvas.place(0, [1, 5, 9, 3], 8, bundle.mask_token_id)
    canvas.forward(1, [w0], [True])
    ref = new_cache(bundle.model)
    forward(bundle.model, canvas.ids, position_ids=canvas.pos, cache=ref, is_causal=False)
    keep = torch.cat([torch.arange(0, w0), torch.arange(w1, T)])
    assert torch.nonzero(canvas.kept_valid[0]).flatten().tolist() == keep.tolist()
    for (keys, values), want in zip(canvas.kept, ref.layers):
        torch.testing.assert_close(keys[:, :, keep], want.keys[:, :, keep], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[:, :, keep], want.values[:, :, keep], atol=1e-5, rtol=1e-5)
    before = [keys.clone() for keys, _ in canvas.kept]
    canvas.forward(1, [w0], [False])
    assert all(torch.equal(keys, old) for (keys, _), old in zip(canvas.kept, before))  # the window's K/V dropped


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_batch_equals_single_rows_under_greedy(cache, shift, impl):
    bundle = dllm(shift, impl=impl)
    prompts = [[1, 5, 9, 3, 11, 12], [1, 7], [1, 20, 21, 22]]
    for kw in (dict(policy="threshold", tau=0.5), dict(policy="top-k", steps=8)):
        batch = DECODERS["diffusion"].decode(bundle, prompts, max_new_tokens=16, block_size=8, cache=cache, **kw)
        for r, p in enumerate(prompts):
            single = DECODERS["diffusion"].decode(bundle, [p], max_new_tokens=16, block_size=8, cache=cache, **kw)
            assert batch.tokens[r] == single.tokens[0]
            assert batch.stats.nfe_per_row[r] == single.stats.nfe_per_row[0]
            assert batch.stats.extra["row_extra"][r] == single.stats.extra["row_extra"][0]


@pytest.mark.parametrize("sampler", ["llada", "dream"])
def test_sampled_batch_equals_single_rows(sampler):
    bundle = dllm(0)
    prompts = [[1, 5, 9, 3], [1, 7]]
    sampling = Sampling(temperature=1.0, seed=3)
    kw = dict(max_new_tokens=16, block_size=8, sampling=sampling, sampler=sampler, tau=0.5)
    batch = DECODERS["diffusion"].decode(bundle, prompts, **kw)
    singles = [DECODERS["diffusion"].decode(bundle, [p], **kw).tokens[0] for p in prompts]
    assert batch.tokens == singles
    greedy = DECODERS["diffusion"].decode(bundle, prompts, max_new_tokens=16, block_size=8, tau=0.5)
    assert batch.tokens != greedy.tokens
    assert batch.stats.extra["sampler"] == sampler


def test_eos_stops_after_the_block_and_reports_tokens_before_it():
    prompt = [1, 5, 9, 3]
    free = DECODERS["diffusion"].decode(dllm(), [prompt], max_new_tokens=32, block_size=8, tau=0.5)
    full = free.tokens[0]
    eos = full[5]  # a token of block 0
    first = full.index(eos)
    out = DECODERS["diffusion"].decode(dllm(stops=(eos,)), [prompt], max_new_tokens=32, block_size=8, tau=0.5,
                           stop_token_ids=(eos,))
    assert out.tokens[0] == full[:first]
    assert out.stats.nfe < free.stats.nfe and out.stats.extra["n_committed"] == [8]  # only block 0 decoded
    early = DECODERS["diffusion"].decode(dllm(), [prompt], max_new_tokens=32, block_size=8, tau=0.5, stop_token_ids=(eos,),
                             eos_early_stop=True)
    assert early.tokens[0] == full[:first]  # committed tokens never change (§9)
    assert early.stats.nfe <= out.stats.nfe
    assert early.stats.extra["n_committed"] == [32]  # trailing EOS fill


def test_early_stop_fills_trailing_eos():
    gen = torch.tensor([[4, 2, 9, 9, 9, 9], [4, 9, 2, 9, 9, 9], [4, 5, 6, 7, 8, 9]])
    gen[1, 1] = 9  # committed, but row 1 below has a mask before its EOS
    gen[0, 3] = 99
    gen[1, 0] = 99
    stopped = early_stop(gen, 99, torch.tensor([2]))
    assert stopped.tolist() == [True, False, False]
    assert gen[0].tolist() == [4, 2, 2, 2, 2, 2] and gen[1].tolist() == [99, 9, 2, 9, 9, 9]


def test_max_new_tokens_maps_to_gen_length():
    bundle = dllm()
    out = DECODERS["diffusion"].decode(bundle, [[1, 5]], max_new_tokens=10, block_size=8, policy="top-k", steps=16)
    assert out.stats.extra["gen_length"] == 16 and len(out.tokens[0]) == 10
    full = DECODERS["diffusion"].decode(bundle, [[1, 5]], max_new_tokens=16, gen_length=16, block_size=8, policy="top-k")
    assert len(full.tokens[0]) == 16 and full.stats.nfe == 16
    # A smaller max_new_tokens cuts the canvas and stops after the block holding the last reported
    # position: the same first tokens, from the first block's forwards only.
    cut = DECODERS["diffusion"].decode(bundle, [[1, 5]], max_new_tokens=4, gen_length=16, block_size=8, policy="top-k")
    assert cut.tokens[0] == full.tokens[0][:4] and cut.stats.nfe == 8
    with pytest.raises(UnmaskError, match="max_new_tokens 17 exceeds gen length 16"):
        DECODERS["diffusion"].decode(bundle, [[1, 5]], max_new_tokens=17, gen_length=16, block_size=8)
    with pytest.raises(UnmaskError, match="eos_early_stop must be true or false"):
        DECODERS["diffusion"].decode(bundle, [[1, 5]], max_new_tokens=8, eos_early_stop="yes")
    default = DECODERS["diffusion"].decode(bundle, [[1, 5]], max_new_tokens=64)
    assert default.stats.extra["block_size"] == 32 and default.stats.extra["policy"] == "threshold"
    short = DECODERS["diffusion"].decode(bundle, [[1, 5]], max_new_tokens=5)
    assert short.stats.extra["block_size"] == 5 and len(short.tokens[0]) == 5


@pytest.mark.parametrize("options, match", [
    (dict(gen_length=30, block_size=8), r"block size 8 does not divide gen length 30; use a block size of .*10"
                                         r".* or a gen length of 24 or 32$"),
    # issue 48 item 7: not "a gen length that is a multiple of 1000"
    (dict(gen_length=64, block_size=1000), r"^block size 1000 is longer than gen length 64; use a block size that "
                                           r"divides 64: 8, 16, 32, 64$"),
    (dict(max_new_tokens=32, block_size=8, steps=2), r"steps must be a positive multiple of the 4 blocks"),
    (dict(max_new_tokens=32, block_size=8, steps=6), r"got 6; use e.g. 4 or 8"),
    (dict(max_new_tokens=32, block_size=8, policy="threshold", steps=8), r"steps applies to the top-k policy only"),
    (dict(max_new_tokens=16, steps=2, tokens_per_step=2), r"either --steps"),
    (dict(max_new_tokens=16, tau=0.0), r"tau must be in \(0, 1\]"),
    (dict(max_new_tokens=16, tau=1.5), r"tau must be in \(0, 1\]"),
    (dict(max_new_tokens=16, cache="full"), r"unknown cache 'full'"),
    (dict(max_new_tokens=16, refresh_every=0), r"refresh_every must be an integer >= 1"),
    (dict(max_new_tokens=16, sampler="maskgit"), r"unknown sampler"),
    (dict(max_new_tokens=16, policy="nope"), r"unknown policy"),
    (dict(max_new_tokens=200, block_size=8), r"exceeds the context window"),
])
def test_bad_inputs_are_one_line_errors(options, match):
    bundle = dllm()
    options = {"max_new_tokens": 16, **options}
    with pytest.raises(UnmaskError, match=match) as info:
        DECODERS["diffusion"].decode(bundle, [[1, 5, 9] * 30], **options)
    assert "\n" not in str(info.value)


def test_model_without_mask_token_and_kind_mismatch():
    bundle = dllm()
    bundle.mask_token_id = None
    with pytest.raises(UnmaskError, match="needs a masked-diffusion model with a mask token"):
        DECODERS["diffusion"].decode(bundle, [[1, 5]], max_new_tokens=8)
    with pytest.raises(UnmaskError, match="decoder 'diffusion' needs a model of kind masked-diffusion"):
        spec_for("diffusion", "causal")


def test_api_rows_and_stop_strings():
    bundle = dllm()
    result = unmask.generate(["5 9 3", "7"], bundle, "diffusion", max_new_tokens=16, block_size=8, cache="dual",
                             tau=0.5)
    rows = result.rows()
    assert [r["policy"] for r in rows] == ["threshold", "threshold"] and rows[0]["cache"] == "dual"
    assert rows[0]["steps"] == rows[0]["nfe"] == len(rows[0]["commits"]) and sum(rows[0]["commits"]) == 16
    text = result.texts[0]
    stop = text.split()[2]  # a token id of block 0 as a stop string
    stopped = unmask.generate(["5 9 3"], bundle, "diffusion", max_new_tokens=16, block_size=8, tau=0.5,
                              stop=[" " + stop])
    assert text.startswith(stopped.texts[0]) and " " + stop not in stopped.texts[0]
    assert stopped.stats.nfe_per_row[0] < rows[0]["nfe"]


def test_stories260K_stand_in_batches_with_dual_cache():
    """The real (causal-trained) checkpoint with an added mask token: meaningless text, but the shapes,
    the dual cache and batch invariance hold on a 5-layer model with a 513-token vocabulary."""
    bundle = unmask.load("stories260K")
    bundle.mask_token_id = add_mask_token(bundle.model)
    bundle.kind = "masked-diffusion"
    prompts = [bundle.encode("Once upon a time"), bundle.encode("Lily"), bundle.encode("The big dog ran to the")]
    kw = dict(max_new_tokens=32, block_size=16, cache="dual", policy="top-k", steps=8)
    batch = DECODERS["diffusion"].decode(bundle, prompts, **kw)
    assert batch.stats.nfe == 8 and all(len(t) <= 32 for t in batch.tokens)
    assert all(0 <= t < 512 for row in batch.tokens for t in row)  # never the mask token
    for r, p in enumerate(prompts):
        assert DECODERS["diffusion"].decode(bundle, [p], **kw).tokens[0] == batch.tokens[r]
    assert math.isclose(batch.stats.tpf, batch.stats.generated / sum(batch.stats.nfe_per_row))
