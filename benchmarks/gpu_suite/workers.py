"""The processes the two-process sections drive (`peers.Peer`): an engine, a plain torch trainer
over the HF model, and the megatron-core trainer. Each takes and returns plain Python values
(token lists, dicts of floats), so nothing but a CUDA IPC handle ever crosses the pipes.

The trainer pushes its weights through `weight_sync.ColocatedSender`, whose buckets are CUDA IPC
handles on a GPU (shared memory on CPU), over a pipe straight to the engine (`link`), which
loads each bucket with `BucketReceiver` and acknowledges; "done" ends the push and the engine
commits.
"""

from __future__ import annotations

import math
import traceback
from multiprocessing.connection import Connection

import torch

from benchmarks.gpu_suite.models import save_weights
from benchmarks.gpu_suite.peers import PipeFuture, recv

SYNC_TIMEOUT_S = 120.0
BUCKET_BYTES = 256 << 20


def memory(device: torch.device) -> dict[str, int]:
    """This process's view of the device: free (driver), reserved and allocated (allocator)."""
    if device.type != "cuda":
        import psutil

        return {"free": psutil.virtual_memory().available}
    torch.cuda.synchronize(device)
    return {
        "free": torch.cuda.mem_get_info(device)[0],
        "reserved": torch.cuda.memory_reserved(device),
        "allocated": torch.cuda.memory_allocated(device),
    }


def samples_of(outs) -> list[list[dict]]:
    return [
        [{"token_ids": list(s.token_ids), "logprobs": list(s.logprobs)} for s in per]
        for per in outs
    ]


class EngineWorker:
    def __init__(self, model_dir: str, engine_kwargs: dict, link: Connection | None = None):
        from rollout import Engine, EngineConfig

        self.engine_kwargs = engine_kwargs
        self.engine = Engine(EngineConfig(model_path=model_dir, **engine_kwargs))
        self.device = self.engine.device
        self.link = link

    def generate(self, prompts: list[list[int]], params: dict) -> list[list[dict]]:
        from rollout import SamplingParams

        return samples_of(self.engine.generate(prompts, SamplingParams(**params)))

    def memory(self) -> dict[str, int]:
        return memory(self.device)

    def release(self, weights: bool = True) -> dict:
        before = memory(self.device)
        released = self.engine.release_memory(weights=weights)
        return {"released": released, "before": before, "after": memory(self.device)}

    def resume(self) -> None:
        self.engine.resume_memory()

    def receive_weights(self) -> dict:
        """Load buckets from the trainer until it says "done", then commit."""
        from weight_sync import BucketReceiver

        receiver = BucketReceiver(self.engine)
        buckets = 0
        while (message := recv(self.link, SYNC_TIMEOUT_S, "the trainer")) != "done":
            try:
                ack = receiver.load(*message)
            except BaseException:
                self.link.send(("error", traceback.format_exc()))
                raise
            self.link.send(("ok", ack))
            buckets += 1
        receiver.commit()
        return {"buckets": buckets, "weight_version": self.engine.weight_version}

    def compare_params(self, model_dir: str) -> dict[str, list[str]]:
        """Against a checkpoint's tensors: `differing`, the parameters whose bytes differ from the
        tensor rounded to the engine's dtype (what loading it must give); `other_dtype`, the
        tensors saved in another dtype than the engine's (a bf16 trainer's fp32 norms, say)."""
        from rollout.weights import iter_safetensors

        params = dict(self.engine.model.named_parameters())
        tied = self.engine.model_config.tie_word_embeddings
        differing, other_dtype = [], []
        for name, tensor in iter_safetensors(model_dir):
            if tied and name == "lm_head.weight":
                name = "model.embed_tokens.weight"
            param = params[name].detach().cpu()
            if tensor.dtype != param.dtype:
                other_dtype.append(f"{name}: {tensor.dtype}")
            if not torch.equal(param, tensor.to(param.dtype)):
                differing.append(name)
        return {"differing": differing, "other_dtype": other_dtype}

    def fresh_generate(self, model_dir: str, prompts, params: dict) -> list[list[dict]]:
        """The same prompts on a new engine, same settings, loaded from `model_dir`."""
        from rollout import Engine, EngineConfig, SamplingParams

        fresh = Engine(EngineConfig(model_path=model_dir, **self.engine_kwargs))
        try:
            return samples_of(fresh.generate(prompts, SamplingParams(**params)))
        finally:
            fresh.release_memory(weights=True)
            del fresh
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def send_weights(link: Connection, named_tensors, device: torch.device) -> dict:
    """Push (hf_name, tensor) pairs to the linked engine's `receive_weights`."""
    from weight_sync import ColocatedSender

    def deliver(handle, manifest):
        link.send((handle, manifest))
        return PipeFuture(link, SYNC_TIMEOUT_S)

    sender = ColocatedSender(deliver, bucket_bytes=BUCKET_BYTES, device=device)
    try:
        report = sender.send(named_tensors)
    finally:
        link.send("done")
    sender.close()
    return report._asdict()


class HFTrainerWorker:
    """A plain torch trainer: the HF model in float32 on the device, AdamW, and a policy-gradient
    step on the engine's samples; exports its weights in the engine's dtype."""

    def __init__(
        self, model_dir: str, device: str, export_dtype: str, link: Connection, lr: float = 1e-4
    ):
        import transformers

        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(0)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.export_dtype = getattr(torch, export_dtype)
        self.tied = bool(self.model.config.tie_word_embeddings)
        self.link = link

    def memory(self) -> dict[str, int]:
        return memory(self.device)

    def train_step(self, sequences: list[tuple[list[int], list[int]]], advantages: list[float]):
        """One AdamW step on sum_i -A_i * mean log p(completion_i | prompt_i)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for (prompt, completion), advantage in zip(sequences, advantages):
            ids = torch.tensor([prompt + completion], device=self.device)
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(completion, device=self.device)[:, None]
            )
            loss = -advantage * logp.mean() / len(sequences)
            loss.backward()
            total += float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9))
        self.optimizer.step()
        return {"loss": total, "grad_norm": norm, "finite": math.isfinite(total + norm)}

    def export(self) -> dict[str, torch.Tensor]:
        return {
            name: t.detach().to(self.export_dtype)
            for name, t in self.model.state_dict().items()
            if not (self.tied and name == "lm_head.weight")
        }

    def send_weights(self) -> dict:
        return send_weights(self.link, self.export().items(), self.device)

    def save(self, directory: str, config_from: str) -> str:
        return save_weights(directory, config_from, self.export())


class MegatronTrainerWorker:
    """The megatron-core policy trainer (`trainer.make_trainer`) on one device, world of 1."""

    def __init__(self, model_dir: str, dtype: str, lr: float, link: Connection):
        from trainer import OptimConfig, TrainerConfig, make_trainer

        self.trainer = make_trainer(
            TrainerConfig(
                model_path=model_dir, backend="megatron", dtype=dtype, optim=OptimConfig(lr=lr)
            )
        )
        from trainer.megatron_runner import device

        self.device = device()
        self.link = link

    def memory(self) -> dict[str, int]:
        return memory(self.device)

    def train_step(self, tokens, prompt_lens, advantages, rollout_logprobs) -> dict:
        from trainer import RLBatch

        batch = RLBatch(
            tokens,
            prompt_lens,
            advantages=[
                torch.full((len(t) - p,), float(a))
                for t, p, a in zip(tokens, prompt_lens, advantages)
            ],
            rollout_logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in rollout_logprobs],
        )
        return {k: float(v) for k, v in self.trainer.train_step(batch).items()}

    def mismatch(self, tokens, prompt_lens, rollout_logprobs) -> dict:
        """Engine vs trainer log-probs on the engine's samples, under the trainer's weights."""
        from trainer import LossConfig, RLBatch
        from trainer.mismatch import mismatch_metrics

        batch = RLBatch(tokens, prompt_lens)
        old = self.trainer.compute_logprobs(batch)
        engine = [torch.tensor(lp, dtype=torch.float32) for lp in rollout_logprobs]
        scored = RLBatch(tokens, prompt_lens, rollout_logprobs=engine, old_logprobs=old)
        return mismatch_metrics(scored, LossConfig())

    def send_weights(self) -> dict:
        return send_weights(self.link, self.trainer.export_hf_weights(), self.device)

    def save(self, directory: str, config_from: str) -> str:
        exported = {n: t.detach().cpu().clone() for n, t in self.trainer.export_hf_weights()}
        return save_weights(directory, config_from, exported)

    def offload(self) -> int:
        return self.trainer.offload()

    def onload(self) -> int:
        return self.trainer.onload()


def digest(t: torch.Tensor | None) -> str | None:
    """A tensor's bytes, hashed (bitwise equality across processes)."""
    import hashlib

    if t is None:
        return None
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


class PrefillDecodeWorker(EngineWorker):
    """One role of prefill-decode disaggregation: `prefill` computes prompts and shares their
    handoffs (CUDA IPC on a GPU, shared memory on CPU: `miles_like.run.handoff_transport`, the
    engine actors' transport on one node); `decode` opens such handoffs in this process and
    decodes them. Each returns its side's digests of the K/V, so the caller checks the bytes
    arrived unchanged."""

    def __init__(self, model_dir: str, engine_kwargs: dict, role: str):
        from miles_like.run.handoff_transport import HandoffReceiver, HandoffSender

        super().__init__(model_dir, engine_kwargs)
        self.sender = HandoffSender(self.device) if role == "prefill" else None
        self.receiver = HandoffReceiver(self.device) if role == "decode" else None

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prefill(self, prompts: list[list[int]], params: dict) -> tuple[int, list, dict]:
        """(key, the shared handoffs, figures: prefill and share seconds, cached tokens,
        digests)."""
        import time

        from rollout import SamplingParams
        from rollout.prefill_decode import prefill

        self._synchronize()
        start = time.perf_counter()
        handoffs = prefill(self.engine, prompts, SamplingParams(**params))
        self._synchronize()
        shared_at = time.perf_counter()
        key, shared = self.sender.share(handoffs)
        done = time.perf_counter()
        return (
            key,
            shared,
            {
                "prefill_s": shared_at - start,
                "share_s": done - shared_at,
                "bytes": sum(h.nbytes for h in handoffs),
                "cached_tokens": [h.cached_tokens for h in handoffs],
                "digests": [(digest(h.k), digest(h.v)) for h in handoffs],
            },
        )

    def release_handoffs(self, key: int) -> None:
        self.sender.release(key)

    def decode(self, shared: list, params: dict) -> tuple[list[list[dict]], dict]:
        """The shared handoffs opened here and decoded: (samples per prompt, figures)."""
        import time

        from rollout import SamplingParams

        start = time.perf_counter()
        opened = self.receiver.open(shared)
        open_s = time.perf_counter() - start
        params = SamplingParams(**params)
        ids = [self.engine.admit_prefilled(h, params) for h in opened]
        done = {}
        while self.engine.has_unfinished():
            done.update((out.request_id, out) for out in self.engine.step())
        self.engine.check_integrity()
        outs = [done[i].samples for i in ids]
        figures = {"open_s": open_s, "digests": [(digest(h.k), digest(h.v)) for h in opened]}
        return samples_of(outs), figures
