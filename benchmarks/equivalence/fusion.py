"""What the fusion pass makes of every Hugging Face causal LM family it is tried on, and whether the
fused program trains exactly as the unfused one.

Each family from a tiny config (2 layers, hidden 32, 4 heads over 2 key-value heads, vocabulary
64, every dropout and router jitter 0), in float64, exported as `autoparallel` exports it
(`torch.export`, the loss transformers computes from `labels=`), then `fuse_kernels`: one row per
family with the fused kernels and their counts, the chains that came close and why not, and the
fused program's loss and gradients against the unfused program's (one forward and backward;
transformers computes the loss in fp32, so 1e-6 is the agreement float64 allows there). A family
that cannot be built or exported here gets its error in its row. Families written with a fused
kernel's whole pattern (Llama and its kin) and the layer forms that only some write (soft caps,
packed projections, interleaved or partial RoPE, GELU written out, MoE routers, MLA) are both in
the list; the MoE families' routed experts are `autoparallel`'s capture's (`mplan inspect`), not
this pass's.

    PYTHONPATH=. python -m benchmarks.equivalence fusion --out benchmarks/results/fusion-cpu-DATE.json
    (--families llama,gpt2 for some; about a minute for all on 2 cores)
"""
from __future__ import annotations

import argparse
import copy
import traceback
from typing import Any

import torch

from benchmarks.equivalence.checks import header

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {  # config class, model class, what SHAPE lacks
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 30.0,
                                                     "attn_logit_softcapping": None}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "sliding_window": 16}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"partial_rotary_factor": 0.25}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.25}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32,
                                               "rotary_dim": 4}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 48, "word_embed_proj_dim": 32}),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_layer": 2, "n_head": 4}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": None}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"residual_multiplier": 0.22, "logits_scaling": 8.0}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {"head_dim": 8}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 8}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 8}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 8}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 8}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 8}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 8}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**MOE, "num_experts": 4,
                                                            "shared_expert_intermediate_size": 24}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "num_experts": 4, "head_dim": 8}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                     "sliding_window": None}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {  # MLA; its router's group limit and bias
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "n_shared_experts": 1,
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "num_key_value_heads": 4}),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 24, "n_shared_experts": 1,
                                                  "first_k_dense_replace": 1, "head_dim": 8}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                                         "moe_intermediate_size": 24, "n_shared_experts": 1,
                                                         "first_k_dense_replace": 1, "head_dim": 8}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {"moe_num_experts": 4, "moe_k": 2,
                                                                       "moe_intermediate_size": 24,
                                                                       "moe_num_shared_experts": 1}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {"num_experts": 4, "moe_topk": 2,
                                                                         "head_dim": 8}),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                               "head_dim": 8}),
}
ATTENTION = {"bloom": "eager", "gemma2": "eager"}  # transformers has no SDPA path for them
ZEROED = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout", "hidden_dropout",
          "activation_dropout", "residual_dropout", "router_jitter_noise", "input_jitter_noise", "layerdrop",
          "summary_first_dropout", "embedding_dropout", "mlp_dropout")
"""Config fields that randomize a training step: zero, so fused and unfused steps are comparable."""
TOLERANCE = 1e-6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated, of {', '.join(FAMILIES)} (default: all)")


def _model(name: str) -> torch.nn.Module:
    import transformers
    from hf_loss import HFLoss  # tests/, put on the path by checks.py

    config_class, model_class, extra = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    for field in ZEROED:
        if isinstance(getattr(config, field, None), float):
            setattr(config, field, 0.0)
    config._attn_implementation = ATTENTION.get(name, "sdpa")
    torch.manual_seed(0)
    return HFLoss(getattr(transformers, model_class)(config).to(torch.float64))


def _row(name: str) -> dict[str, Any]:
    from distributed import rel_err

    from mplan.passes.fuse_kernels import fuse_kernels

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=generator)
    labels = torch.randint(0, 64, (2, 12), generator=generator)
    unfused = torch.export.export(_model(name), (ids, labels), strict=False).module()
    fused = fuse_kernels(copy.deepcopy(unfused))
    report = fused.meta["fuse_kernels"]
    results = []
    for gm in (fused, unfused):
        loss = gm(ids, labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in gm.named_parameters() if p.grad is not None}))
    (loss, grads), (ref_loss, ref_grads) = results
    # a gradient that is zero in exact arithmetic (a key bias under softmax) is compared by its norm
    scale = max(float(g.norm()) for g in ref_grads.values())
    grad_err = max(float((grads[n] - g).norm()) / max(float(g.norm()), 1e-9 * scale) for n, g in ref_grads.items())
    loss_err, same = rel_err(loss, ref_loss), grads.keys() == ref_grads.keys()
    return {"fused": dict(sorted(report.counts.items())), "missed": report.missed, "loss_rel_err": loss_err,
            "grad_rel_err": grad_err, "same_gradients": same,
            "agrees": loss_err <= TOLERANCE and grad_err <= TOLERANCE and same}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for name in args.families.split(","):
        try:
            rows[name] = _row(name)
        except Exception as exc:  # noqa: BLE001 - a family that cannot be built here is a row, not a crash
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                          "where": traceback.format_exc().strip().splitlines()[-3:]}
    print("| family | fused | missed (why) | loss / grad rel. error |\n|---|---|---|---|")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | error: {row['error']} | | |")
            continue
        fused = ", ".join(f"{k} x{v}" for k, v in row["fused"].items())
        missed = "; ".join(f"{k}: {why}" for k, reasons in row["missed"].items() for why in reasons)
        print(f"| {name} | {fused} | {missed or '-'} | {row['loss_rel_err']:.0e} / {row['grad_rel_err']:.0e} |")
    return {**header(), "table": "fusion", "tolerance": TOLERANCE, "families": rows,
            "all_agree": all(row.get("agrees", False) for row in rows.values())}
