"""Log-probabilities and entropy of target tokens under `logits / T`, vocab-parallel under TP.

Each TP rank holds a slice of the vocabulary (megatron `parallel_output=True`); we never gather
the full logits. With z = logits / T on the rank's slice:

    m        = max over the whole vocab (all-reduce MAX; a constant shift, so no gradient)
    S        = sum_v exp(z_v - m)                      (all-reduce SUM)
    log Z    = m + log S
    logprob  = z_target - log Z                        (z_target lives on one rank; SUM)
    entropy  = log Z - sum_v p_v z_v,  p_v = exp(z_v - m) / S

Sums go through megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward,
identity backward): the loss is computed identically on every TP rank, so the gradient of each
rank's partial sum is the gradient of the total. Padded vocab rows (megatron pads the vocab to
a TP-divisible size) are excluded from every sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

import collectives


class TokenLogProbs(NamedTuple):
    logprobs: torch.Tensor  # [t]
    entropy: torch.Tensor  # [t]


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> TokenLogProbs:
    """logits: [t, V_local] this rank's vocab slice (math in fp32 or wider); targets: [t]
    global token ids.

    `vocab_size` is the real (unpadded) vocabulary size. `entropy_grad=False` returns the
    entropy detached (a metric only, no entropy bonus): autograd then keeps nothing of it."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local_v = logits.shape[-1]
    start = tp_rank * local_v
    # bf16 / fp16 logits are upcast: the softmax sums need fp32 at least
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    valid = torch.arange(start, start + local_v, device=z.device) < vocab_size
    neg_inf = torch.finfo(z.dtype).min

    m = z.detach().masked_fill(~valid, neg_inf).amax(dim=-1)
    collectives.all_reduce(
        m, op=collectives.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
    )
    shifted = z - m.unsqueeze(-1)
    e = shifted.exp() * valid
    sum_e = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    log_z = m + sum_e.log()

    local_t = targets - start
    on_rank = (local_t >= 0) & (local_t < local_v)
    picked = z.gather(-1, local_t.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1) * on_rank
    z_target = reduce_from_tensor_model_parallel_region(picked)
    logprobs = z_target - log_z

    if not with_entropy:
        return TokenLogProbs(logprobs, torch.zeros_like(logprobs))
    with torch.enable_grad() if entropy_grad else torch.no_grad():
        p = e / sum_e.unsqueeze(-1)
        pz = reduce_from_tensor_model_parallel_region((p * z.masked_fill(~valid, 0.0)).sum(dim=-1))
        entropy = log_z - pz
    return TokenLogProbs(logprobs, entropy)


def full_vocab_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> TokenLogProbs:
    """The same quantities when one process holds the whole vocabulary (HF / DeepSpeed path)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(z, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return TokenLogProbs(picked, entropy)
