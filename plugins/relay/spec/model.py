"""Building blocks for spec models: strict pydantic models whose fields can be marked resume-critical.

A resume-critical key is one that must not change between the chunks of one training run: changing
it turns the run into another experiment (or makes its checkpoints unloadable).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_MARK = "resume_critical"


class StrictModel(BaseModel):
    """Unknown keys are errors; values are immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def critical(default: Any = ..., **kwargs: Any) -> Any:
    """A Field that is resume-critical."""
    extra = kwargs.pop("json_schema_extra", {}) or {}
    return Field(default, json_schema_extra={**extra, _MARK: True}, **kwargs)


def is_critical(model: type[BaseModel], field: str) -> bool:
    """Whether `field` of `model` is marked resume-critical."""
    extra = model.model_fields[field].json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(_MARK))


def critical_values(obj: BaseModel, prefix: str = "", inherited: bool = False) -> dict[str, Any]:
    """Flatten the resume-critical leaves of a model into {dotted.key: value}.

    A field marked critical makes its whole subtree critical; an unmarked sub-model is searched.
    """
    out: dict[str, Any] = {}
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        key = f"{prefix}{name}"
        crit = inherited or is_critical(type(obj), name)
        if isinstance(value, BaseModel):
            out.update(critical_values(value, key + ".", crit))
        elif crit:
            out[key] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return out
