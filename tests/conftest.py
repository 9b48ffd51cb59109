"""Every test belongs to exactly one group (``unit``, ``distributed`` or ``e2e``, set by each
file's ``pytestmark``), so ``pytest -m unit`` is a subset nothing falls out of unnoticed. Tests
marked ``slow`` (the full-size headline plans and benchmarks, minutes each) are skipped, and say
so, unless ``--slow`` is given."""

from __future__ import annotations

import pytest

from upipe_dtensor.kernels.fused import restored_backend

GROUPS = ("unit", "distributed", "e2e")


@pytest.fixture(autouse=True)
def _tile_kernels_as_before():
    """A test that builds a compiled job's model sets the tiled ops' kernel backend for the
    process (``kernels.fused``); the next test starts from the one before."""
    with restored_backend():
        yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (full-size plans and benchmarks, minutes each)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--slow")
    for item in items:
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow (minutes); run with --slow"))
        marked = [group for group in GROUPS if item.get_closest_marker(group)]
        if len(marked) != 1:
            raise pytest.UsageError(
                f"{item.nodeid} is marked {marked or 'with no group'}; set exactly one of "
                f"pytestmark = pytest.mark.{{{','.join(GROUPS)}}} in its file (tests/README.md)"
            )
