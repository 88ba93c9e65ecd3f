"""``self_draft``: the target's own first layers and its LM head as the draft (early exit,
as in LayerSkip / "draft & verify" self-speculation).

No second checkpoint and no second KV cache: the draft's layers are the target's (the same
modules, the same weights), so the KV the target wrote for them is the draft's KV too. The
draft reads the residual stream after ``num_draft_layers`` layers through the target's
final norm and head (pruned to a draft vocabulary if one is given: at a few layers the
head is most of the draft's cost).

How good the drafts are depends on how much of the answer the early layers already carry;
an untrained early exit of a small model accepts little, which the per-sequence adaptive
switch-off (libs/engine/spec/adaptive.py) then keeps from costing anything.
"""

from __future__ import annotations

import torch

from libs.engine.spec.model_proposer import DraftNetwork, ModelProposer
from libs.engine.spec.vocab import DraftVocab
from libs.model.llama import LlamaModel


def early_exit_network(target: LlamaModel, num_layers: int, vocab: DraftVocab | None) -> DraftNetwork:
    if not 1 <= num_layers < len(target.layers):
        raise ValueError(f"self_draft: num_draft_layers must be in [1, {len(target.layers) - 1}] for this model, got {num_layers}")
    head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    if vocab is not None:
        head = vocab.prune_head(head)
    return DraftNetwork(target, num_layers, head)


def self_draft_proposer(target: LlamaModel, num_layers: int, vocab: DraftVocab | None, *, block_size: int, device: torch.device, bind) -> ModelProposer:
    network = early_exit_network(target, num_layers, vocab)
    return ModelProposer("self_draft", network, vocab=vocab, block_size=block_size, device=device, shares_target_cache=True, bind=bind)
