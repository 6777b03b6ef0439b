"""The engine's host-sync budget: a decode step reads the device back a fixed number of times,
whatever the batch.

On a GPU every read of a device tensor from Python (`item`, `tolist`, `bool`, `nonzero`,
`cpu`, `numpy`, `int`, `float`) waits for the device to finish the queued work. Counting those
calls during `Engine.step` on the CPU (a `TorchFunctionMode` sees each one) shows what a GPU run
would wait for. The budget per steady decode step: one read of the sampled tokens, one of the
verified drafts under speculation, and one per drafted position of a draft model (its next input
ids). The same count at 8 and at 64 sequences, with and without speculation.

The one exemption: `numpy()` of a slot table. On the CPU the engine writes a sequence's new
page slots through numpy on the table's memory (`rollout.kv_pool.write_page_slots`); on a
device the table lives there and the same write is a host-to-device copy, never a read back.
"""

from __future__ import annotations

import collections
import copy
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rollout import Engine, EngineConfig, SamplingParams
from rollout.sampler import SamplingBatch, _sample_torch, sample

from tiny_hf import save_hf_model

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
}


class HostReads(TorchFunctionMode):
    """Counts reads of tensors back to the host (with the line that made each)."""

    def __init__(self, exempt_numpy: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.exempt = exempt_numpy
        self.where: collections.Counter[str] = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS and not (
            func is torch.Tensor.numpy and any(args[0] is t for t in self.exempt)
        ):
            caller = traceback.extract_stack(limit=2)[0]
            self.where[f"{func.__name__} at {caller.filename}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def qwen3_draft_dir(tiny_hf_checkpoints, tmp_path_factory):
    """The target's weights plus noise: a draft model that is sometimes right."""
    model, _ = tiny_hf_checkpoints("qwen3")
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    return str(save_hf_model(draft, tmp_path_factory.mktemp("sync_draft")))


def decode_step_reads(engine: Engine, num_seqs: int, temperature: float) -> list[HostReads]:
    """Host reads of each of 6 steady decode steps of `num_seqs` sequences (each prompt
    repeats a motif, so lookup proposers find drafts)."""
    g = torch.Generator().manual_seed(num_seqs)
    for i in range(num_seqs):
        motif = torch.randint(0, 101, (3,), generator=g).tolist()
        params = SamplingParams(temperature=temperature, max_new_tokens=64, ignore_eos=True, seed=i)
        engine.add_request(motif * 4, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_generated < 2 for s in scheduler.running):
        engine.step()
    assert len(scheduler.running) == num_seqs
    tables = [scheduler.slot_table]
    if engine.draft_model is not None:
        tables.append(engine.draft_model.slot_table)
    steps = []
    for _ in range(6):
        with HostReads(exempt_numpy=tuple(tables)) as reads:
            engine.step()
        steps.append(reads)
    assert len(scheduler.running) == num_seqs, "a sequence finished inside the counted steps"
    return steps


@pytest.mark.parametrize(
    "method, budget",
    [(None, 1), ("ngram", 2), ("draft", 2 + 4)],  # draft: one read per drafted position (4)
)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_decode_step_reads_do_not_grow_with_the_batch(
    tiny_hf_checkpoints, qwen3_draft_dir, method, budget, temperature
):
    _, directory = tiny_hf_checkpoints("qwen3")
    config = EngineConfig(
        model_path=str(directory),
        page_size=2,  # a page boundary every other token: page writes are in the steps
        speculative_method=method,
        speculative_draft_model_path=qwen3_draft_dir if method == "draft" else None,
        speculative_min_acceptance=0.0,  # always draft
    )
    per_size = {}
    for num_seqs in (8, 64):
        steps = decode_step_reads(Engine(config), num_seqs, temperature)
        worst = max(steps, key=lambda r: r.count)
        assert worst.count <= budget, (
            f"{num_seqs} sequences, speculation {method}: {worst.count} host reads in one "
            f"decode step (budget {budget}):\n{dict(worst.where)}"
        )
        per_size[num_seqs] = worst.count
    assert per_size[64] == per_size[8], per_size


def test_torch_sampler_reads_nothing_back():
    """The device path of the sampler (`_sample_torch`) on a batch mixing greedy, truncated and
    plain rows makes no host read; the scheduler then reads tokens and log-probs in one, and
    they are the sampler's."""
    from rollout.config import SamplingParams as SP
    from rollout.sampler import read_back
    from rollout.sequence import Request, Sequence

    settings = [
        SP(temperature=0.0),
        SP(temperature=0.8, top_k=5),
        SP(temperature=1.0),
        SP(temperature=1.3, top_p=0.7, min_p=0.05),
    ]
    seqs = [
        Sequence(Request(r, [1, 2], settings[r % len(settings)], base_seed=r), 0) for r in range(16)
    ]
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.of(seqs)
    with HostReads() as reads:
        tokens, logprobs = _sample_torch(logits, batch)
    assert reads.count == 0, dict(reads.where)
    with HostReads() as reads:
        host_tokens, host_logprobs = read_back(tokens, logprobs)
    assert reads.count == 1, dict(reads.where)
    assert host_tokens == tokens.tolist() and host_logprobs == logprobs.tolist()
    # the same draws as `sample` (the C kernel where it applies) on the same batch
    expected_tokens, expected_logprobs = sample(logits, batch)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-6)
