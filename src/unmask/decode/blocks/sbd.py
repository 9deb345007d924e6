"""Set Block Decoding with an exact KV cache (SBD Algorithms 2 and 3, spec/sbd.md §4).

Prefill the prompt causally, then decode block by block: every block starts as k mask
tokens; each forward predicts all still-masked block positions at their own positions (block
mode, Eq. 9b) and the commit policy (default: the EB sampler, §5.1) reveals at least one of
them. Committed blocks are final.

The cache stays exact (§4.1): block K/V computed under bidirectional, noisy attention are
cropped after every forward, and the first forward of the next block re-feeds the committed
block causally together with the k new masks (one fused forward over 2k tokens), so only the
causal K/V of committed text ever stay in the cache.

The decoding itself is :class:`unmask.decode.blocks.batch.BlockDecoder`, the running batch SBD shares
with SingleBD (the re-feed is its causal store region). On the static cache every forward has one of
at most four query shapes — k or 2k tokens, and the same for a shorter last block — so
``compile=True`` reuses one graph per shape.

With ``verify`` (or the checkpoint's default) the same decoder runs *lossless* SBD instead
(spec/sbd_exact.md): the block mode only drafts, the NTP mode verifies in the same forward, and the
output equals ``ar`` decoding of the model, on the verify batch (:mod:`unmask.decode.verify`).
:meth:`SBDOptions.resolve` decides which, once, and resolves everything either path needs.
"""

from __future__ import annotations

from dataclasses import dataclass


from unmask.decode.blocks.batch import running_batch
from unmask.decode.blocks.prefix import check_cache_flags
from unmask.decode.engine.knobs import PolicyKnobs
from unmask.decode.engine.registry import Spec, knob
from unmask.decode.verify import layout as dl
from unmask.decode.verify.batch import Verify
from unmask.decode.verify.config import DEFAULT_DRAFT, HOST_LAYOUT, VerifyConfig, default_block_size, queries
from unmask.decode.verify.drafting import HOST, DraftKnobs
from unmask.errors import UnmaskError, is_int
from unmask.policies import EntropyBound, Policy, gamma_option, make_policy

DEFAULT_BLOCK_SIZE = 16
DEFAULT_PRESET = "chat-low"
# decode_defaults keys of lossless SBD (spec/sbd_exact.md); "block_size" stays the lossy path's
LOSSLESS_KEYS = ("verify", "draft", "verify_block_size", "queries", "draft_layouts")


@dataclass(frozen=True)
class SBDConfig:
    """Block size k (default 16, §4) and the commit policy (default EB, entropy proxy, γ of the
    ``chat-low`` preset)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    policy: Policy = EntropyBound.preset(DEFAULT_PRESET)

    def __post_init__(self):
        if not is_int(self.block_size) or self.block_size < 1:
            raise UnmaskError(f"block size must be an integer >= 1 (got {self.block_size!r}); 16 is the paper's "
                              "default")

    @classmethod
    def from_options(cls, *, block_size=None, policy=None, gamma=None, preset=None, tau=None, factor=None,
                     tokens_per_step=None, defaults: dict | None = None) -> "SBDConfig":
        """Build from CLI-style options; raises UnmaskError for invalid combinations.

        ``defaults`` (a checkpoint's ``decode_defaults`` in unmask_config.json, e.g.
        ``{"block_size": 8, "gamma": 0.35}``) fills the block size and, when no policy option is
        given at all, the policy; explicit options always win.
        """
        defaults = dict(defaults or {})
        default_size = defaults.pop("block_size", None)
        block_size = default_size if block_size is None else block_size
        if all(v is None for v in (policy, gamma, preset, tau, factor, tokens_per_step)) and defaults:
            return cls.from_options(block_size=block_size, **defaults)
        name = policy or "entropy-bound"
        gamma = gamma_option(gamma, preset)
        if gamma is None and name in ("entropy-bound", "confidence-bound", "margin-bound"):
            gamma = DEFAULT_PRESET
        params = {"gamma": gamma, "tau": tau, "f": factor, "k": tokens_per_step}
        built = make_policy(name, **{k: v for k, v in params.items() if v is not None})
        return cls(block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size, policy=built)


POLICY_OPTIONS = ("policy", "gamma", "preset", "tau", "factor", "tokens_per_step")
NO_MASK = ("the sbd decoder needs a model with a mask token (an SBD fine-tuned model); train one with "
           "'unmask train sbd'")


@dataclass(frozen=True)
class SBDOptions(PolicyKnobs, DraftKnobs):
    """Set Block Decoding's knobs: the block and its commit policy (lossy EB path, SBD §4-5), or
    lossless SBD's draft and draft source (spec/sbd_exact.md, spec/draft_sources.md). :meth:`resolve`
    turns them, with the checkpoint's ``decode_defaults``, into the config that runs."""

    sources = ("block", *HOST, *(f"block+{h}" for h in HOST))

    block_size: int | None = knob("block size k (--verify: the draft size K; default the model's, else 16)", low=1,
                                  short="-k")
    verify: bool | None = knob("lossless SBD: the NTP mode verifies the block-mode draft (output = ar); default "
                               "from the model")
    draft: str | None = knob("--verify: draft layout, linear, quadratic, budget (the model's calibrated layout for "
                             "--queries) or D/S/G text such as 3/0,2,3/4, with siblings: 3/0,1,3/4+1g3 "
                             "(spec/sbd_exact.md §5.3); default from the model")
    queries: int | None = knob("--verify, budgeted draft: query tokens per row per forward (default: the "
                               "model's, else 16)", low=1)

    def __post_init__(self):
        """DraftKnobs' checks, and: a model-free source alone drafts without the block mode, so no
        block knob may size it (checked here, not in :meth:`resolve`, so a server request is refused too)."""
        super().__post_init__()
        if self.host_only and (self.draft is not None or self.queries is not None or self.block_size is not None):
            raise UnmaskError(f"--draft-source {self.draft_source} drafts without the block mode, so --block-size, "
                              f"--draft and --queries do not apply; size it with --draft-tokens, or choose "
                              f"--draft-source block+{self.draft_source}")

    def lossless(self, bundle) -> bool:
        """Whether these options run lossless SBD: ``verify`` when set, else the checkpoint's default
        unless a policy option asks for the lossy path. Raises UnmaskError for options that contradict
        (a policy option with ``verify``, ``draft`` / ``queries`` without it)."""
        if self.verify is not None and not isinstance(self.verify, bool):
            raise UnmaskError(f"verify must be true or false (got {self.verify!r}); pass --verify or --no-verify")
        given = [f"--{k.replace('_', '-')}" for k in POLICY_OPTIONS if getattr(self, k) is not None]
        if self.verify and given:
            it = "them" if len(given) > 1 else "it"
            raise UnmaskError(f"{', '.join(given)} set a lossy commit policy, which lossless SBD (--verify) does not "
                              f"use; drop {it} or pass --no-verify")
        defaults = bundle.meta.get("decode_defaults") or {}
        if self.draft_source is not None and not given and self.verify is None:
            return True  # a draft source is lossless SBD's
        lossless = self.verify if self.verify is not None else (not given and bool(defaults.get("verify", False)))
        only = [flag for flag, value in (("--draft", self.draft), ("--queries", self.queries),
                                         ("--draft-source", self.draft_source)) if value is not None]
        if only and not lossless:
            flags, it = (" and ".join(only), "them") if len(only) > 1 else (only[0], only[0])
            raise UnmaskError(f"{flags} appl{'y' if len(only) > 1 else 'ies'} to lossless SBD only; add --verify or "
                              f"drop {it}")
        return lossless

    def layout(self, bundle) -> str:
        """The draft layout lossless SBD runs (:func:`unmask.decode.verify.layout.option`, then
        :func:`~unmask.decode.verify.layout.resolve`: a budget as its ``D/S/G`` text). Raises UnmaskError."""
        defaults = bundle.meta.get("decode_defaults") or {}
        draft = dl.option(self.draft, self.block_size, defaults, DEFAULT_DRAFT)
        return dl.resolve(getattr(draft, "spec", draft), self.queries, defaults)

    def takes_grammar(self, bundle) -> bool:
        """Lossless SBD takes a grammar (its verify applies the masks exactly); the lossy policies do not."""
        return self.lossless(bundle)

    def resolve(self, bundle) -> "VerifyConfig | SBDConfig":
        """The one resolution of these options on ``bundle``: a :class:`VerifyConfig` (lossless: K the
        request's, else the checkpoint's ``verify_block_size``, else 8; the :meth:`layout`) checked
        against the context window, or an :class:`SBDConfig` (lossy: the checkpoint's ``decode_defaults``
        fill what is not given). Raises UnmaskError (one line) for a model without a mask token,
        contradicting options or a bad value."""
        if self.host_only and self.lossless(bundle):
            return VerifyConfig(self.host_drafts(bundle.device).tokens + 1, HOST_LAYOUT)
        if bundle.mask_token_id is None:
            raise UnmaskError(NO_MASK)
        if self.lossless(bundle):
            K = default_block_size(bundle) if self.block_size is None else self.block_size
            cfg = VerifyConfig.of(K, self.layout(bundle))
            cfg.check_fits(bundle.context_length)
            return cfg
        defaults = {k: v for k, v in (bundle.meta.get("decode_defaults") or {}).items() if k not in LOSSLESS_KEYS}
        cfg = SBDConfig.from_options(block_size=self.block_size, **{k: getattr(self, k) for k in POLICY_OPTIONS},
                                     defaults=defaults)
        if cfg.block_size > bundle.context_length:
            raise UnmaskError(f"block size {cfg.block_size} exceeds the context window of {bundle.context_length}; "
                              "lower --block-size")
        return cfg

    def batch_key(self, bundle, max_new_tokens: int):
        """Lossless: ``("verify", layout)``, the verify batch it shares with ``ar`` rows (a bad block size
        is reported when the row joins); lossy: ``("sbd", self)``; None (the request runs per call, its
        decode reports the error) for contradicting options or a bad layout."""
        try:
            if not self.lossless(bundle):
                return "sbd", self
            return "verify", HOST_LAYOUT if self.host_only else self.layout(bundle)
        except UnmaskError:
            return None


def batch(bundle, cfg: SBDOptions, *, capacity: int, prompts=None, max_new_tokens=None, compile: bool = False,
          static: bool = False, on_step=None, on_token=None, on_forward=None, stop_token_ids=None):
    """The running batch of ``cfg`` (:meth:`SBDOptions.resolve`): lossless, a
    :class:`~unmask.decode.verify.batch.Verify` at its K; lossy, a
    :class:`~unmask.decode.blocks.batch.BlockDecoder` (``prompts`` given: :meth:`Spec.decode`'s, rows in
    lockstep; None: the server's, rows moving on at once, a static cache of the context window and
    three blocks of slack, new step shapes compiled when idle). ``compile``: the static cache and a
    compiled forward (same tokens and NFE; stats.extra records ``compiled`` and ``static_cache``);
    ``static``: the static cache eagerly; lossless takes ``on_forward`` only eagerly. Raises
    UnmaskError as :meth:`SBDOptions.resolve` does and for a non-bool ``compile`` / ``static``."""
    run = cfg.resolve(bundle)
    check_cache_flags(compile, static)
    longest = None if prompts is None else max((len(p) for p in prompts), default=1) + max_new_tokens
    if isinstance(run, VerifyConfig):
        if (compile or static) and on_forward is not None:
            raise UnmaskError("compile=True / static=True take no on_forward hook (the static cache is not a "
                              "DynamicCache); drop one of them")
        length = None if longest is None else longest + run.block_size + queries(run.block_size, run.draft)
        return Verify(bundle, run, static=static, compile=compile, capacity=capacity, on_step=on_step,
                      on_token=on_token, on_forward=on_forward, stop_token_ids=stop_token_ids, length=length,
                      drafts=cfg.host_drafts(bundle.device, run.block_size))
    return running_batch(bundle, run, capacity=capacity, prompts=prompts, compile=compile, static=static,
                         on_step=on_step, on_token=on_token, on_forward=on_forward, stop_token_ids=stop_token_ids)


def runs_lossless(bundle, options: dict) -> bool:
    """Whether the sbd options ``options`` (a dict; other keys ignored) run lossless SBD; False when
    they contradict (their decode reports it)."""
    try:
        keys = ("verify", "draft", "draft_source", *POLICY_OPTIONS)  # a draft source is lossless SBD's
        return SBDOptions(**{k: options.get(k) for k in keys}).lossless(bundle)
    except UnmaskError:
        return False


SPEC = Spec("sbd", SBDOptions, batch=batch, kinds=("sbd",), compiles=True,
            summary="Set Block Decoding: block of masks, EB sampler, exact KV cache")
