"""Reference model families built from a few numbers: GPT (2/3), Llama (2/3) and MoE (Mixtral).

Models are plain nn.Modules with a fixed naming scheme (see gpt.py, llama.py, moe.py) that
the planner and passes rely on, build on the meta device in well under a second at any
size, export with torch.export on meta, and initialize deterministically from a seed
(`init_weights`). `build_model(spec)` turns any command-line model spec into a module.
"""

from __future__ import annotations

from mplan.models.config import GPTConfig, LlamaConfig, ModelConfig, MoEConfig, TransformerConfig
from mplan.models.decoder import DecoderLM
from mplan.models.gpt import GPTModel
from mplan.models.llama import LlamaModel
from mplan.models.moe import MoELayer, MoEModel
from mplan.models.presets import PRESETS
from mplan.models.spec import ModelSource, build_model, example_inputs, resolve_model

__all__ = [
    "PRESETS",
    "DecoderLM",
    "GPTConfig",
    "GPTModel",
    "LlamaConfig",
    "LlamaModel",
    "ModelConfig",
    "ModelSource",
    "MoEConfig",
    "MoELayer",
    "MoEModel",
    "TransformerConfig",
    "build_model",
    "example_inputs",
    "resolve_model",
]
