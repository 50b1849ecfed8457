"""A Hugging Face causal LM as the fusion tests export it: (input_ids, labels[, attention_mask])
-> the loss transformers computes from `labels=`, without the key-value cache."""
from __future__ import annotations

import torch
from torch import nn


class HFLoss(nn.Module):
    """`model`'s loss as the module's only output (what `autoparallel` trains on)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, attention_mask=attention_mask, use_cache=False).loss
