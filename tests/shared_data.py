"""Locating shared/reference/data: the frames and vectors captured from the real engines.

CI lays shared/ beside the clone (``../shared``); KVMISS_SHARED_DIR overrides.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    env = os.environ.get("KVMISS_SHARED_DIR")
    return Path(env) if env else REPO.parent / "shared"


def load_json(name: str) -> dict:
    path = shared_dir() / "reference" / "data" / name
    if not path.exists():
        if os.environ.get("KVMISS_REQUIRE_SHARED"):
            pytest.fail(f"reference capture {path} is required (KVMISS_REQUIRE_SHARED is set)")
        pytest.skip(f"reference capture {path} is not present (set KVMISS_SHARED_DIR)")
    return json.loads(path.read_text())


def frames(b64_frames: list[str]) -> list[bytes]:
    return [base64.b64decode(f) for f in b64_frames]
