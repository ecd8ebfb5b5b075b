"""The services above the libraries (rollout/, reward/, trainer/), in six wings and the config they share.

    run_folder/  what a run folder holds and who reads it: checkpoints, metrics, curves, trackers, inspect
    testbeds/    each testbed's settings, behaviour, pre-training and REST request model, by name
    config.py    the whole job's config (YAML presets, `key=value` overrides), one section per part
    serving/     the reward ensemble as a Ray Serve application with a REST API
    runtime/     the Ray and the local runtimes: rollout pool, learner group, actors, placement
    driver/      the controller loop, the Python API, the CLI, the `ray job submit` entrypoint, resume, evaluation
    api/         the package `steadyrl` itself (its front door: `steadyrl.train`, `load_run`, `Run`)

Each wing imports only the libraries and the wings listed above it (docs/architecture.md); only runtime/ and
serving/ import Ray.
"""
