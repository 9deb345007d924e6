"""Adding a mask token to a model whose tokenizer has none (spec/sbd.md §2, Option A).

The new id is ``vocab_size`` (one past the last row); its input embedding is the exact mean
of the existing rows (deterministic, our choice). With tied embeddings the row is also an
output logit, which every decoder suppresses. The id is *not* added to the tokenizer, so no
plain text can ever encode to it (our choice); it is recorded in ``unmask_config.json``.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def add_mask_token(model) -> int:
    """Grow ``model``'s vocabulary by one row for the mask token and return its id.

    The input embedding row (and the output row of an untied LM head) is set to the mean of
    the existing rows. Mutates ``model`` (config.vocab_size grows by one).
    """
    emb = model.get_input_embeddings().weight  # (V, d)
    mask_id = emb.shape[0]
    mean_in = emb.mean(dim=0)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    mean_out = None if head is None or tied else head.weight.mean(dim=0)
    model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
    model.get_input_embeddings().weight[mask_id] = mean_in
    if mean_out is not None:
        model.get_output_embeddings().weight[mask_id] = mean_out
    return mask_id
