from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.timer.helpers import Harness


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.close()
