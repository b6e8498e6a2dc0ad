"""Fixtures of the zoo tests (the reference computation lives in ``_zoo_reference.py``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _zoo_reference import analysed  # noqa: E402,F401 - the fixture
