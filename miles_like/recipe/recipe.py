"""`Recipe`: everything a run needs, as one frozen, validated config of sections.

    recipe = load_recipe("recipes/tiny_arith_grpo.yaml", ["rollout.n=4", "trainer.lr=1e-5"])

A recipe YAML has the top-level keys `steps`, `seed` and one mapping per section (`model` and
`data` are required; `sections.py`). Building a `Recipe` (loading one, or in code, with
`dataclasses.replace` too) checks every field and each section's own rules, then that the
engine and trainer configs it maps onto accept it (their own checks, reported under the
recipe's field names: `build_configs.check_configs`), then the rules across sections
(`rules.py`). So a `Recipe` built in code is as checked as a loaded one. `load_recipe`
(`load.py`) adds reading the file, the overrides and, unless `check_paths_exist=False`, the
filesystem (`paths.py`).
"""

from __future__ import annotations

from pydantic import Field

from config_schema import Namer, config
from miles_like.recipe.build_configs import check_configs
from miles_like.recipe.rules import check_sections
from miles_like.recipe.sections import (
    AlgorithmSection,
    CheckpointSection,
    ClusterSection,
    DataSection,
    ModelSection,
    RewardSection,
    RolloutSection,
    Section,
    SFTSection,
    TrackingSection,
    TrainerSection,
)


@config
class Recipe(Section):
    PREFIX = ""  # the top level: its fields are named `steps`, `rollout.n`, ...
    model: ModelSection = Field(description="the policy model")
    data: DataSection = Field(description="the prompts")
    steps: int = Field(100, description="RL steps", ge=1)
    seed: int = Field(0, description="seed of sampling, initialization and synthetic data")
    sft: SFTSection = Field(default_factory=SFTSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)

    def check(self, name: Namer) -> None:
        check_configs(self)  # first: the rules below assume every field is in its range
        check_sections(
            data=self.data,
            rollout=self.rollout,
            algorithm=self.algorithm,
            trainer=self.trainer,
            cluster=self.cluster,
            checkpoint=self.checkpoint,
        )

    @property
    def async_buffer_groups(self) -> int:
        """cluster.async_buffer_groups resolved (its null default)."""
        c = self.cluster
        if c.async_buffer_groups is not None:
            return c.async_buffer_groups
        return self.rollout.prompts_per_step * (c.max_staleness + 1)
