"""Job entrypoint for `ray job submit -- python -m steadyrl.services.driver.job CONFIG key=value ...` and KubeRay RayJobs.

Inside a job, `ray.init()` joins the cluster through $RAY_ADDRESS; the loop is the same as on a laptop.
"""
from __future__ import annotations

import sys

from steadyrl.services.driver.cli import app


def main(argv: list[str] | None = None) -> None:
    app(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
