"""recoveries.jsonl: each time a run restarted itself from its last checkpoint after losing a component it could
not recover in place (a learner rank's node, a rollout worker past its retries): when, what failed, the step it
went back to, the steps redone and the seconds from the failure to training again."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECOVERIES_LOG = "recoveries.jsonl"


def append_recovery(run_dir: Path, entry: dict[str, Any]) -> None:
    """One line per restart (`Controller.run`, once the checkpoint is restored)."""
    with (Path(run_dir) / RECOVERIES_LOG).open("a") as f:
        f.write(json.dumps(entry) + "\n")


def read_recoveries(run_dir: Path) -> list[dict[str, Any]]:
    """The run's restarts, oldest first ([] for a run that never restarted)."""
    path = Path(run_dir) / RECOVERIES_LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
