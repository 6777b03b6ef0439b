"""The FP8 KV pool's scales, a deterministic function of the weights.

`calibrate_kv_scales` runs the model's reference forward (the plain layer functions, eager, not
compiled or native pieces, and exact causal attention over the sequence itself, no pool) over a
fixed calibration sequence, takes each (layer, KV head)'s largest |K| and |V| (K after RoPE and
the QK norm, as the pool stores it) and turns them into power-of-two scales with a margin
(`rollout.kv_quant.scales_from_amax`). Values beyond the margin saturate when stored.

Why a calibration prefill: the engine's scales after every weight update must equal a fresh
computation from the trainer's weights, bitwise, and must never fall back to a default. A
function of the weights alone (same tokens, same code, same device and dtype) gives exactly
that, before any request arrives; rounding the scale to a power of two leaves it unchanged by
rounding noise in the amax except at a binade's edge. Scales measured from live traffic
(vLLM's and SGLang's `calculate_kv_scales`, from the first batch) would depend on which prompts
came first, and checkpoint-provided scales do not follow the trainer's updates.

The calibration sequence is `CALIBRATION_TOKENS` token ids drawn from a CPU generator with a
fixed seed (the same ids on every machine), covering the vocabulary uniformly; fewer for a model
whose context is shorter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.kv_quant import scales_from_amax
from rollout.model import CausalLM, DecoderLayer

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0


def calibration_ids(vocab_size: int, length: int = CALIBRATION_TOKENS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (length,), generator=generator)


@torch.inference_mode()
def calibration_amax(model: CausalLM, length: int = CALIBRATION_TOKENS):
    """Largest |K| and |V| per (layer, KV head) over the calibration sequence: two float32
    tensors [L, Hkv] on the model's device."""
    device = model.model.embed_tokens.weight.device
    length = min(length, model.rotary.cos.shape[0])  # a model with a shorter context
    ids = calibration_ids(model.config.vocab_size, length).to(device)
    positions = torch.arange(ids.shape[0], device=device)
    x = model.model.embed_tokens(ids)
    k_amax, v_amax = [], []
    for layer in model.model.layers:
        q, k, v = DecoderLayer.attention_inputs(layer, x, positions, model.rotary)
        k_amax.append(k.abs().amax(dim=(0, 2)).to(torch.float32))
        v_amax.append(v.abs().amax(dim=(0, 2)).to(torch.float32))
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        x = DecoderLayer.attention_outputs(layer, x, attended.transpose(0, 1))
    return torch.stack(k_amax), torch.stack(v_amax)


def calibrate_kv_scales(model: CausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 pool's K and V scales [L, Hkv] for the model's current weights."""
    k_amax, v_amax = calibration_amax(model)
    return scales_from_amax(k_amax), scales_from_amax(v_amax)
