"""Mixture-of-experts reference model (Mixtral style): Llama blocks whose MLP is routed.

Names (a contract for the planner and passes): as `LlamaModel`, with each block's
`mlp` a `MoELayer`: `mlp.router` (Linear hidden -> E, no bias) and `mlp.experts.{w_gate,
w_up, w_down}`, the SwiGLU weights of all experts stacked on dim 0 ([E, ffn, h], [E, ffn, h],
[E, h, ffn]) so expert parallelism shards dim 0.

Routing (Mixtral): probabilities = softmax(router logits) (in at least float32), each token
picks its top-k experts, and the k weights are renormalized to sum to one.

Dispatch has static shapes, so torch.export captures it without data-dependent sizes:
- the T tokens' k choices are flattened choice-major (every token's first choice, then
  every second choice...), so when capacity binds, first choices win over second ones (GShard);
- a choice's position inside its expert is a cumulative sum over a one-hot mask;
- expert capacity C (`MoEConfig.capacity`) is T when dropless, so nothing is ever dropped;
  choices at positions >= C are dropped: they go to one overflow slot that is sliced away
  and contribute zero (the token keeps its residual and any other choice, unrenormalized);
- tokens are gathered into an [E, C, h] buffer, the experts run as batched matmuls, and
  results are added back per token weighted by the gate.

Load balancing (Switch Transformer, Megatron normalization): aux = E * sum_e f_e * P_e with
f_e the fraction of the T*k routed choices (before dropping) that chose expert e and P_e the
mean router probability of e; it is 1 when routing is perfectly balanced. Each layer
returns its own; the model adds `aux_loss_coef * sum over layers` to the LM loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mplan.models.config import MoEConfig
from mplan.models.llama import LlamaBlock, LlamaModel, Rope


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights; forward maps [E, C, h] -> [E, C, h]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.bmm(x, self.w_gate.transpose(1, 2))
        up = torch.bmm(x, self.w_up.transpose(1, 2))
        return torch.bmm(F.silu(gate) * up, self.w_down.transpose(1, 2))


class MoELayer(nn.Module):
    """forward(x [B, S, h]) -> (y [B, S, h], load-balancing loss (scalar))."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden, config.ffn)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_experts, top_k = self.config.num_experts, self.config.top_k
        hidden = x.shape[-1]
        tokens = x.reshape(-1, hidden)
        num_tokens = tokens.shape[0]
        capacity = self.config.capacity(num_tokens)

        # bf16 router probabilities make top-k ties and a noisy aux loss; never go below float32
        prob_dtype = torch.promote_types(tokens.dtype, torch.float32)
        probs = self.router(tokens).softmax(dim=-1, dtype=prob_dtype)  # [T, E]
        top_weight, top_expert = probs.topk(top_k, dim=-1)  # [T, k]
        top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)

        expert = top_expert.t().reshape(-1)  # [k*T], choice-major
        weight = top_weight.t().reshape(-1).to(tokens.dtype)
        token = torch.arange(num_tokens, device=x.device).repeat(top_k)
        # comparison rather than F.one_hot, whose eager range check reads tensor values
        one_hot = (expert.unsqueeze(1) == torch.arange(num_experts, device=x.device)).long()
        position = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=1)
        overflow = num_experts * capacity
        slot = torch.where(position < capacity, expert * capacity + position, overflow)

        # index_add, not index_copy: several dropped choices share the overflow slot
        gathered = tokens.index_select(0, token)
        buffer = tokens.new_zeros(overflow + 1, hidden).index_add(0, slot, gathered)
        expert_out = self.experts(buffer[:overflow].view(num_experts, capacity, hidden))
        expert_out = torch.cat([expert_out.reshape(overflow, hidden), expert_out.new_zeros(1, hidden)])
        routed = expert_out.index_select(0, slot) * weight.unsqueeze(1)
        y = tokens.new_zeros(num_tokens, hidden).index_add(0, token, routed)

        fraction = one_hot.sum(dim=0).to(prob_dtype) / (num_tokens * top_k)  # f_e
        aux_loss = num_experts * (fraction * probs.mean(dim=0)).sum()
        return y.view_as(x), aux_loss


class MoEBlock(LlamaBlock):
    """A Llama block with a `MoELayer` as its MLP; returns (x, load-balancing loss)."""

    def _make_mlp(self, config: MoEConfig) -> nn.Module:  # type: ignore[override]
        return MoELayer(config)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), rope)
        y, aux_loss = self.mlp(self.mlp_norm(x))
        return x + y, aux_loss


class MoEModel(LlamaModel):
    """forward(input_ids, labels=None) -> logits, or LM loss + aux_loss_coef * sum of layer aux losses."""

    config: MoEConfig
    block_type = MoEBlock

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        rope = self.rope(input_ids.shape[1])
        x = self.embed(input_ids)
        aux_losses = []
        for layer in self.layers:
            x, aux_loss = layer(x, rope)
            aux_losses.append(aux_loss)
        if labels is None:
            return self.logits(x)
        return self.output(x, labels) + self.config.aux_loss_coef * torch.stack(aux_losses).sum()
