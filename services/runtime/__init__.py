"""Runtimes: where the rollout pool and the learner run. `RayRuntime` places them as Ray actors (placement
groups, object store, weight broadcast); `LocalRuntime` runs the same objects in this one process, without Ray.

Imports: the libraries, run_folder/, testbeds/, config and serving/ (to deploy the reward app). With serving/,
the only wing that imports Ray; `local_runtime` and what it uses import none.
"""
