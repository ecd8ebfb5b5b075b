"""A run folder, written and read: checkpoints and their `latest` pointer, metrics.jsonl and its curves,
experiment trackers, and the readers behind `steadyrl inspect` / `compare` (dashboard, HTML report).

Imports: the libraries only. No Ray.
"""
