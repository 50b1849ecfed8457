"""Mixture-of-experts reference model (Mixtral style): Llama blocks whose MLP is routed.

Names (a contract for the planner and passes): as `LlamaModel`, with each block's
`mlp` a `MoELayer`: `mlp.router` (Linear hidden -> E, no bias) and `mlp.experts.{w_gate,
w_up, w_down}`, the SwiGLU weights of all experts stacked on dim 0 ([E, ffn, h], [E, ffn, h],
[E, h, ffn]) so expert parallelism shards dim 0; with `shared_ffn`, `mlp.shared_expert`, a
dense SwiGLU every token runs beside its routed experts (Qwen-MoE and DeepSeek's shared expert).

Routing (Mixtral): probabilities = softmax(router logits) (in at least float32), each token
picks its top-k experts, and the k weights are renormalized to sum to one.

The experts run as one op, `mplan.kernels.moe.moe_experts` (which capture keeps as one graph
node and the runtime dispatches over expert-parallel ranks): each token's k choices go to their
experts and come back weighted by the gate. Capacity (`MoEConfig.capacity_factor`, None =
dropless): each expert keeps at most ceil(capacity_factor * k * T / E) choices, counted
choice-major (every token's first choice, then every second one, so first choices win, GShard);
a dropped choice contributes zero (the token keeps its residual and any other choice).

Load balancing (Switch Transformer, Megatron normalization): aux = E * sum_e f_e * P_e with
f_e the fraction of the T*k routed choices (before dropping) that chose expert e and P_e the
mean router probability of e; it is 1 when routing is perfectly balanced. Each layer
returns its own; the model adds `aux_loss_coef * sum over layers` to the LM loss.
"""

from __future__ import annotations

import torch
from torch import nn

from mplan.kernels.moe import moe_experts
from mplan.models.config import MoEConfig
from mplan.models.layers import SwiGLU
from mplan.models.llama import LlamaBlock, LlamaModel, Rope


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights; forward(tokens [T, h], index [T, k], gate [T, k])."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.capacity_factor = capacity_factor

    def forward(self, tokens: torch.Tensor, index: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return moe_experts(tokens, index, gate, self.w_gate, self.w_down, self.w_up, activation="silu",
                           capacity_factor=self.capacity_factor)


class MoELayer(nn.Module):
    """forward(x [B, S, h]) -> (y [B, S, h], load-balancing loss (scalar))."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden, config.ffn, config.capacity_factor)
        self.shared_expert = SwiGLU(config.hidden, config.shared_ffn) if config.shared_ffn else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_experts, top_k = self.config.num_experts, self.config.top_k
        tokens = x.reshape(-1, x.shape[-1])
        # bf16 router probabilities make top-k ties and a noisy aux loss; never go below float32
        prob_dtype = torch.promote_types(tokens.dtype, torch.float32)
        probs = self.router(tokens).softmax(dim=-1, dtype=prob_dtype)  # [T, E]
        top_weight, top_expert = probs.topk(top_k, dim=-1)  # [T, k]
        top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        y = self.experts(tokens, top_expert, top_weight.to(tokens.dtype))
        if self.shared_expert is not None:
            y = y + self.shared_expert(tokens)

        # f_e counts the routed choices (before any drop); a comparison rather than F.one_hot,
        # whose eager range check reads tensor values
        chosen = (top_expert.unsqueeze(-1) == torch.arange(num_experts, device=x.device)).to(prob_dtype)
        fraction = chosen.mean(dim=(0, 1))  # f_e (a mean: no arithmetic on the symbolic batch)
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
