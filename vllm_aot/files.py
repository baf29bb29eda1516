"""Files written whole or not at all: staged beside the target, then renamed over it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, payload: Any) -> None:
    """`payload` as JSON at `path`; a reader sees the old file or the new one, never half."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(staging, path)
