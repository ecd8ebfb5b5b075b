"""Thread counts for torch work whose float32 results must not depend on the process running it."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def using_threads(n: int) -> Iterator[None]:
    """torch on `n` intra-op threads inside the block, the caller's count restored after.

    float32 reductions (matmul, convolution, their gradients) sum in an order set by the thread count, so the
    same computation on 1 and on 2 threads can differ in the last bits.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
