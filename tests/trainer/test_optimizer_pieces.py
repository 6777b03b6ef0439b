"""`trainer/optim.py`'s step pieces against torch's own references: the float64 grad norm
against the closed form, and an unfused AdamW state resumed into the trainer's fused AdamW
(`load_optimizer_state`) against the unfused optimizer continuing."""

from __future__ import annotations

import copy

import torch

from trainer.optim import grad_norm, load_optimizer_state

SHAPES = [(7, 5), (5,), (3, 4, 2), (1,)]


def _params(seed: int, dtype=torch.float64) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _set_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def test_grad_norm_is_the_float64_l2_norm():
    params = _params(0, torch.float32)
    _set_grads(params, 0)
    params[1].grad = None  # a parameter without a gradient counts nothing
    want = sum(float((p.grad.double() ** 2).sum()) for p in params if p.grad is not None) ** 0.5
    assert abs(grad_norm(params, model_parallel=False) - want) <= 1e-14 * want


def _adamw(params, fused: bool):
    return torch.optim.AdamW(
        [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )


def test_unfused_state_resumes_fused_with_the_same_update():
    params = _params(1)
    unfused = _adamw(params, fused=False)
    for step in range(2):
        _set_grads(params, step)
        unfused.step()
    saved_weights = [p.detach().clone() for p in params]
    # a copy, as a checkpoint holds (state_dict() shares the live state tensors)
    saved_state = copy.deepcopy(unfused.state_dict())
    for step in range(2, 4):  # the reference: the unfused optimizer goes on
        _set_grads(params, step)
        unfused.step()
    want = [p.detach().clone() for p in params]

    resumed = [torch.nn.Parameter(w.clone()) for w in saved_weights]
    fused = _adamw(resumed, fused=True)
    load_optimizer_state(fused, saved_state)
    assert all(group["fused"] for group in fused.param_groups)
    for p in resumed:
        assert fused.state[p]["step"].device == p.device
    for step in range(2, 4):
        _set_grads(resumed, step)
        fused.step()
    for a, b in zip(resumed, want, strict=True):
        assert float((a.detach() - b).abs().max()) <= 1e-14
    assert float(fused.state[resumed[0]]["step"]) == 4.0
