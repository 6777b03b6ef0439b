"""`Config`, the base of every config, and `@config`, which makes a subclass a validated frozen
pydantic dataclass whose errors are one line.

Why pydantic dataclasses (not `BaseModel`): a config stays a dataclass, so the code that reads
one (`dataclasses.replace`, `fields`, `asdict`, positional arguments, `FrozenInstanceError`) is
unchanged, and `replace` validates the new value like the constructor does.
"""

from __future__ import annotations

import functools
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar, Union

from pydantic import ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import ArgsKwargs, PydanticCustomError

from config_schema.describe import bare, is_config, yaml_repr
from config_schema.messages import WRONG_TYPE, display_name, one_line

C = TypeVar("C")
# `name(field)`: a field's name in error messages (`field_namer`)
Namer = Callable[[str], str]

# Lax mode (a mapping becomes a nested config, a list a tuple, "1e-6" a float), with what lax mode
# would read into a value the user did not write refused by `as_written`; NaN and infinities are
# refused (no setting means either), so is any key the config does not declare.
SETTINGS = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)


class ConfigError(ValueError):
    """A bad config value: one line that names the field and the fix."""

    def __init__(self, message: str):
        # One line, always: a command line prints it as is.
        super().__init__(" ".join(str(message).split()))


class Renamed(NamedTuple):
    """A field's former name, accepted with a warning for one release. `convert` maps a value of
    the old field onto the new one (a bool onto a choice, say) and raises ValueError, saying what
    the old field took, on anything else."""

    new: str
    convert: Callable[[Any], Any] | None = None


def prefix_of(cls: type) -> str:
    return cls.PREFIX if cls.PREFIX is not None else cls.__name__


def _namer(cls: type, info: ValidationInfo | None) -> Namer:
    context = (info.context if info is not None else None) or {}
    if context.get("config") is not cls:  # a nested config names its fields itself
        context = {}
    prefix = context.get("prefix", prefix_of(cls))
    return functools.partial(display_name, prefix=prefix, names=context.get("names", {}))


def field_namer(config: Any, info: ValidationInfo | None = None) -> Namer:
    """`name(field)`: how errors of `config` name its field. By default `PREFIX.field`; a config
    built by `validate(..., prefix=, names=)` names them as its builder says (the recipe names
    `EngineConfig.tp` `rollout.tp` and `EngineConfig.dtype` `model.dtype`)."""
    return _namer(type(config), info)


def _fits(hint: Any) -> Callable[[Any], bool]:
    """Whether a value is what a field of type `hint` holds as written (see `as_written`)."""
    hint = bare(hint)
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        arms = [_fits(arm) for arm in typing.get_args(hint)]
        return lambda v: any(fits(v) for fits in arms)
    if origin is Literal:
        # `type(a) is type(v)`: True == 1 in Python, but `true` is not a valid `0 | 1`
        choices = typing.get_args(hint)
        return lambda v: any(a == v and type(a) is type(v) for a in choices)
    if hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:  # a string: pydantic parses it, or says it is not a number
        return lambda v: isinstance(v, (int, float, str)) and not isinstance(v, bool)
    if hint is str:
        return lambda v: isinstance(v, str)
    return lambda v: True  # tuples item by item (`as_written`); the rest: pydantic's checks


def _only_choices(hint: Any) -> bool:
    """`hint` is a Literal, or an optional one: a mismatch is a choice not allowed."""
    if typing.get_origin(hint) is Literal:
        return True
    return typing.get_origin(hint) in (Union, types.UnionType) and all(
        a is type(None) or typing.get_origin(bare(a)) is Literal for a in typing.get_args(hint)
    )


def _section(value: Any) -> Any:
    if value is None:  # `rollout:` with nothing under it: the defaults
        return {}
    if isinstance(value, Mapping):  # YAML keys may be ints or bools: unknown keys, named
        return {str(k): v for k, v in value.items()}
    return value


def as_written(hint: Any) -> Callable[[Any], Any]:
    """The check of a value for a field of type `hint` (built once per field): it refuses what
    pydantic's lax mode would turn into a value the user did not write (a bool where a number or
    a choice is meant, a number or a string where a bool is meant, a float or a string where an
    int is meant), reads a missing section as an empty one and a section's keys as strings."""
    hint = bare(hint)
    if typing.get_origin(hint) in (Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(arms) == 1:  # Optional[X]: as X, or None
            inner = as_written(arms[0])
            return lambda v: None if v is None else inner(v)
    if is_config(hint):
        return _section
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        repeated = args[-1] is Ellipsis
        checks = [_fits(a) for a in (args[:1] if repeated else args)]

        def items(value: Any) -> Any:
            if isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if not checks[0 if repeated else min(i, len(checks) - 1)](v):
                        raise PydanticCustomError(WRONG_TYPE, "not the declared type", {"index": i})
            return value

        return items
    fits = _fits(hint)
    kind = "literal_error" if _only_choices(hint) else WRONG_TYPE

    def scalar(value: Any) -> Any:
        if not fits(value):
            raise PydanticCustomError(kind, "not of the declared type")
        return value

    return scalar


@functools.cache
def _field_check(cls: type, field: str) -> Callable[[Any], Any]:
    return as_written(cls.__pydantic_fields__[field].annotation)


@dataclass(frozen=True, config=SETTINGS)
class Config:
    """Base of every config (decorate each subclass with `@config`). Class attributes:

    * `PREFIX`: how errors name the fields, `PREFIX.field` (None: the class name; a recipe
      section's is its dotted path, the whole recipe's is empty);
    * `ERROR`: the `ConfigError` subclass raised;
    * `SUGGEST`: names other tools use for our fields, suggested in the unknown-key error;
    * `RENAMED`: former field names, still accepted for one release with a `DEPRECATION`
      warning.
    """

    PREFIX: ClassVar[str | None] = None
    ERROR: ClassVar[type[ConfigError]] = ConfigError
    SUGGEST: ClassVar[dict[str, str]] = {}
    RENAMED: ClassVar[dict[str, Renamed]] = {}
    DEPRECATION: ClassVar[type[Warning]] = DeprecationWarning

    def check(self, name: Namer) -> None:
        """Rules across fields, run after every field has passed its own checks: raise
        ValueError with one line naming the fields with `name(field)` and saying the fix."""

    @model_validator(mode="before")
    @classmethod
    def _accept_renamed(cls, data: Any, info: ValidationInfo) -> Any:
        kwargs = data.kwargs if isinstance(data, ArgsKwargs) else data
        if not cls.RENAMED or not isinstance(kwargs, Mapping):
            return data
        old_names = [old for old in cls.RENAMED if old in kwargs]
        if not old_names:
            return data
        name = _namer(cls, info)
        kwargs = dict(kwargs)
        for old in old_names:
            new, convert = cls.RENAMED[old]
            if new in kwargs:
                raise ValueError(
                    f"{name(old)} is the former name of {name(new)}; set {name(new)} only"
                )
            value = kwargs.pop(old)
            try:
                kwargs[new] = convert(value) if convert else value
            except ValueError as e:
                raise ValueError(f"{name(old)}={yaml_repr(value)}: {e}") from None
            new_value = kwargs[new]  # as a recipe writes it: `policy_loss: gspo`
            shown = new_value if isinstance(new_value, str) else yaml_repr(new_value)
            written = f": {shown}" if convert else ""
            warnings.warn(
                f"{name(old)} is deprecated; write {name(new)}{written} instead (the old "
                "name goes in the next release)",
                cls.DEPRECATION,
                stacklevel=2,
            )
        return ArgsKwargs(data.args, kwargs) if isinstance(data, ArgsKwargs) else kwargs

    @field_validator("*", mode="before")
    @classmethod
    def _as_written(cls, value: Any, info: ValidationInfo) -> Any:
        return _field_check(cls, info.field_name)(value)

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Config:
        self.check(field_namer(self, info))
        return self


def config(cls: type[C]) -> type[C]:
    """Make `cls` (a `Config` subclass) a frozen pydantic dataclass whose construction raises
    `cls.ERROR` with one line instead of pydantic's report."""
    cls = dataclass(frozen=True, config=SETTINGS)(cls)
    validated_init = cls.__init__

    @functools.wraps(validated_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            validated_init(self, *args, **kwargs)
        except ValidationError as e:
            kind = type(self)
            raise kind.ERROR(one_line(e, kind, prefix_of(kind), {})) from None

    cls.__init__ = __init__
    return cls


def validate(
    cls: type[C],
    values: Mapping[str, Any],
    *,
    prefix: str | None = None,
    names: Mapping[str, str] | None = None,
    error: type[ConfigError] | None = None,
) -> C:
    """`cls(**values)`, its errors naming fields as the caller knows them: `prefix.field`, or
    `names[field]` for a field taken from elsewhere (e.g. `{"dtype": "model.dtype"}`). Build
    nested configs with their own call: the naming applies to `cls`'s fields."""
    prefix = prefix_of(cls) if prefix is None else prefix
    names = dict(names or {})
    try:
        return cls.__pydantic_validator__.validate_python(
            dict(values), context={"config": cls, "prefix": prefix, "names": names}
        )
    except ValidationError as e:
        raise (error or cls.ERROR)(one_line(e, cls, prefix, names)) from None
