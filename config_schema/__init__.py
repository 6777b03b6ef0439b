"""Typed, frozen, validated configs: one mechanism for the recipe's sections and the package
configs (`rollout.EngineConfig`, `rollout.SamplingParams`, `trainer.TrainerConfig`, ...).

    @config
    class EngineConfig(Config):
        page_size: int = Field(16, ge=1)
        \"\"\"Tokens per KV page.\"\"\"

        def check(self, name):
            if ...:
                raise ValueError(f"{name('page_size')}=...: ...; set it to ...")

A config is a frozen pydantic dataclass: its fields' types, ranges (`Field(ge=, gt=, le=, lt=)`)
and choices (`Literal`) are declared once and checked on construction, `dataclasses.replace`
included; `check(name)` holds the rules across fields. A bad value raises one `ConfigError` line
(a `ValueError`) naming the field and the fix; never pydantic's multi-line report.

Types are taken as written (`base.as_written`): no bool where a number or a choice is meant, no
number or string where a bool is meant, an int only where a float is; a string that parses as a
float is a float (PyYAML reads `1e-6` as a string); a list is a tuple; an empty mapping (or none)
is a section of defaults.

A leaf package (it imports nothing of ours), so `rollout`, `trainer` and `miles_like` all use it.
"""

from config_schema.base import Config, ConfigError, Namer, Renamed, config, field_namer, validate
from config_schema.describe import describe, to_plain, type_name, yaml_repr
from config_schema.messages import closest

__all__ = [
    "Config",
    "ConfigError",
    "Namer",
    "Renamed",
    "closest",
    "config",
    "describe",
    "field_namer",
    "to_plain",
    "type_name",
    "validate",
    "yaml_repr",
]
