"""The `rig` fixture: one case's real parts, stopped whatever happens."""

from __future__ import annotations

import pytest
from reliability_rig import Rig


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    if r.kvmiss is not None:  # shown by pytest only when the case failed
        print("--- kvmiss serve log (tail) ---\n" + r.kvmiss.tail(60))
    r.close()
