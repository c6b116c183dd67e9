"""Where the harnesses and experiments put their results: one JSON writer, so every script makes its folder and
says what it wrote the same way."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` (indented JSON, folders made) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    print(f"\nwrote {path}")
