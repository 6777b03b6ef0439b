"""rollout: the generation engine (paged KV, radix prefix cache, continuous batching, sampling).

from rollout import Engine, EngineConfig, SamplingParams
engine = Engine(EngineConfig(model_path=DIR))
outs = engine.generate(prompt_token_ids, SamplingParams(n=8, max_new_tokens=128))
outs[i][j].token_ids, outs[i][j].logprobs, outs[i][j].finish_reason
"""

from rollout.config import EngineConfig, SamplingParams
from rollout.engine import Engine
from rollout.sequence import RequestOutput, SampleOutput

__all__ = ["Engine", "EngineConfig", "SamplingParams", "SampleOutput", "RequestOutput"]
