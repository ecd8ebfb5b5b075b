"""The arith testbeds: one task (arithmetic or a task file, an exact verifier) through three model families,
each with its pre-training: `masked` (a masked-diffusion LM), `autoregressive` (a causal LM) and
`block_diffusion` (blockwise masked diffusion over a causal LM)."""
