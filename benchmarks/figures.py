"""What the benchmarks share for their figures: a measured series as its median and min..max, and a results file
written with its summary printed."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def spread(values: list[float]) -> dict[str, float]:
    """Median and min..max of a measured series (the machine is shared and noisy: never a single run)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write_json(result: dict[str, Any], out: str | Path, leave_out_of_summary: tuple[str, ...] = ("runs",)) -> Path:
    """Write `result` to `out` (folders made) and print it without the bulky keys."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in leave_out_of_summary}, indent=2))
    return out
