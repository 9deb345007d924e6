"""Commit policies: which masked positions to reveal this step, and with which token.

Every decoder (SBD, LLaDA, Fast-dLLM, Dream, block diffusion) calls :func:`commit` once per forward.
It is a pure, batched function of the logits and the mask; the policy is a frozen config dataclass.

- :mod:`unmask.policies.configs`: the policies (EntropyBound, Threshold, Factor, TopK, EntropyThreshold),
  the γ presets and :func:`make_policy`;
- :mod:`unmask.policies.token_stats`: κ, H and Δ of q, suppression, token draws;
- :mod:`unmask.policies.commit_rule`: :func:`commit`.

Conventions shared by every policy (SBD §5, diffusion.md §0, §4, §6, §7):

* Tokens are drawn from softmax(logits / T) for T > 0 (the argmax for T = 0), in float32 (SBD §5.1 step 1).
* Commit decisions (κ, H, Δ) read softmax(logits), the untempered q, at every T unless asked otherwise:
  a decoder then tends to its T = 0 behaviour as T → 0 (at T = 0.1 the tempered κ of most positions
  rounds to 1.0, which would commit a whole block in one step and make γ = 0 commit several tokens).
  Dream's convention, κ and H under softmax(logits / T), is ``confidence="tempered"`` (diffusion.md §4,
  SBD §5.2, which read the tempered q; our choice to default to the untempered one).
* Ranking is a stable sort: equal scores go to the lower position. Non-masked positions are never ranked
  before masked ones and are never committed.
* A row with r >= 1 masked positions commits between 1 and r of them; a row with r = 0 commits nothing.
  The one exception is an explicit TopK ``quota`` of 0 (LLaDA with more steps than block tokens).
* Decoders set the mask-token logit to -inf themselves (see :func:`suppress`) before calling.
"""

from unmask.policies.commit_rule import commit
from unmask.policies.configs import (CONFIDENCES, GAMMA_PRESETS, POLICY_NAMES, EntropyBound, EntropyThreshold, Factor,
                                     Policy, Threshold, TopK, gamma_option, make_policy)
from unmask.policies.token_stats import TokenStats, gumbel_argmax, suppress, token_stats

__all__ = ["CONFIDENCES", "GAMMA_PRESETS", "POLICY_NAMES", "EntropyBound", "EntropyThreshold", "Factor", "Policy",
           "Threshold", "TokenStats", "TopK", "commit", "gamma_option", "gumbel_argmax", "make_policy", "suppress",
           "token_stats"]
