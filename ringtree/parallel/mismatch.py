"""The first tensor two state_dicts disagree on: the sentence a load of another model's state says."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class MismatchError(ValueError):
    """A state_dict that does not fit the model it is loaded into, naming the first tensor."""


def check_keys(expected: Mapping[str, Any], given: Mapping[str, Any], source: str = "the state_dict") -> None:
    """MismatchError naming the first tensor `given` lacks, has in another shape, or has extra."""
    for name, value in expected.items():
        if name not in given:
            raise MismatchError(f"{source} has no {name!r}, which this model holds; load one saved from it")
        if tuple(given[name].shape) != tuple(value.shape):
            raise MismatchError(
                f"{name!r} has shape {tuple(given[name].shape)} in {source} but {tuple(value.shape)} "
                "in this model; load one saved from the same model"
            )
    extra = [k for k in given if k not in expected]
    if extra:
        raise MismatchError(f"{source} holds {extra[0]!r}, which this model does not; load one saved from it")
