"""Tiny random-init Hugging Face checkpoints, built locally with transformers.

HF transformers is the independent reference in our tests: we build a model with it, save it
as `config.json` + `model.safetensors`, and compare our engine / trainer against it on the same
weights. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

# One small config per supported family; each exercises a different feature mix:
# qwen2: QKV bias, untied; qwen3: q/k-norm, explicit head_dim != hidden/heads, tied;
# llama: no bias, llama3 rope scaling, untied.
FAMILIES: dict[str, dict] = {
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=101,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=89,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
}


# Mixtures of experts, kept apart from FAMILIES (the dense suites iterate over that): qwen3_moe:
# q/k-norm, renormalised top-k, a dense layer between two sparse ones (mlp_only_layers), tied;
# qwen2_moe: QKV bias, a shared expert with its sigmoid gate, top-k not renormalised, untied.
MOE_FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=103,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}


def hf_config(family: str, **overrides):
    import transformers

    kwargs = {**FAMILIES, **MOE_FAMILIES}[family] | overrides
    model_type = kwargs.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def make_hf_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A random-init HF causal LM in eval mode. Weights are drawn with a larger std than HF's
    default so that logits are far from uniform and greedy decoding is decisive."""
    import transformers

    config = hf_config(family, **overrides)
    torch.manual_seed(seed)
    # a mixture's experts as HF's plain per-expert loop (its grouped GEMM has no float64)
    experts = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **experts)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def save_hf_model(model, directory: str | Path) -> Path:
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def save_bpe_tokenizer(directory: str | Path, corpus: list[str], vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on `corpus`, with Qwen-style chat markers and template,
    saved as a Hugging Face tokenizer directory (what a real model directory holds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return fast
