"""The model description both the engine and the trainer read: a Hugging Face `config.json`
dict of the Llama / Qwen2 / Qwen3 family
(and the Qwen2-MoE / Qwen3-MoE mixtures of experts), parsed once into a frozen `ModelSpec`.

One parser for both sides, so they cannot disagree about a checkpoint: Hugging Face
transformers' own reading of a config.json is the arbiter (the tests compare against
`AutoConfig` and `ROPE_INIT_FUNCTIONS`). A config either side cannot run exactly is refused here
with one line naming the config.json key; what only one side cannot run (the megatron trainer
has no o_proj or MLP bias) is that side's check.

A leaf package: it imports torch and nothing of ours, so `rollout` and `trainer` both use it
without importing each other. It does not import transformers (the engine's import cost).
"""

from model_spec.moe import MOE_MODEL_TYPES, MoESpec
from model_spec.rope import SUPPORTED_ROPE_TYPES, RopeSpec
from model_spec.spec import SUPPORTED_MODEL_TYPES, ModelSpec, UnsupportedModelError

__all__ = [
    "MOE_MODEL_TYPES",
    "MoESpec",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "ModelSpec",
    "RopeSpec",
    "UnsupportedModelError",
]
