"""Tests marked slow (minutes on a 2-core machine) run only when RINGTREE_SLOW_TESTS=1."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("RINGTREE_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set RINGTREE_SLOW_TESTS=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
