"""The arith testbeds: one task (arithmetic or a task file, an exact verifier: `testbed.py`) through three model
families (`family.py`), each module holding its family, settings and registered testbed, with its pre-training beside
it: `masked` (a masked-diffusion LM), `autoregressive` (a causal LM) and `block_diffusion` (uniform-noise block
diffusion over a causal prefix)."""
