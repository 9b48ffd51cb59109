"""Every test belongs to exactly one group (``unit``, ``distributed`` or ``e2e``, set by each
file's ``pytestmark``), so ``pytest -m unit`` is a subset nothing falls out of unnoticed."""

from __future__ import annotations

import pytest

GROUPS = ("unit", "distributed", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        marked = [group for group in GROUPS if item.get_closest_marker(group)]
        if len(marked) != 1:
            raise pytest.UsageError(
                f"{item.nodeid} is marked {marked or 'with no group'}; set exactly one of "
                f"pytestmark = pytest.mark.{{{','.join(GROUPS)}}} in its file (tests/README.md)"
            )
