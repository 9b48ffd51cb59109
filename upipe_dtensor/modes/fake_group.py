"""The stand-in run's fill of fake collectives: inside ``local_data_in_fake_collectives``, the
exchanges this package makes over a fake process group fill their outputs with local data
(``runtime.fake_process_group`` says why and how; ``fill_as_received`` asks ``filling``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_filling = False


@contextlib.contextmanager
def local_data_in_fake_collectives() -> Iterator[None]:
    """Inside, exchanges over a fake group fill their outputs with local data
    (``runtime.fake_process_group``): the stand-in run's steps stay finite."""
    global _filling
    previous, _filling = _filling, True
    try:
        yield
    finally:
        _filling = previous


def filling() -> bool:
    """Whether exchanges over a fake group fill their outputs now."""
    return _filling
