"""The arith testbed's data half: a character tokenizer and seeded synthetic problems (no download).

Tasks (each a prompt and a fixed-length completion, both token ids):
  addition: "a+b=" with a, b zero-padded to `digits` digits; completion = str(a + b), then <eos> to the
            generation length. E.g. digits=2: "07+45=" -> "52<eos><eos>".
  sudoku:   a 4x4 grid, 0 = blank, row-major in the prompt: "1034|0200|..." ; completion = the 16 digits
            of a solution (checked against the rules, not against one stored answer).
Problem i of a split is a pure function of (task, split seed, i): workers, evals and the verifier
agree without passing problems around.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Sequence

import torch
from torch import Tensor

PAD, MASK, EOS = "<pad>", "<mask>", "<eos>"
SPECIALS = (PAD, MASK, EOS)
CHARS = tuple("0123456789+=|")

Task = Literal["addition", "sudoku"]


class CharTokenizer:
    """Specials first (<pad>=0, <mask>=1, <eos>=2), then one id per character."""

    def __init__(self) -> None:
        self.vocab = list(SPECIALS) + list(CHARS)
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.pad_id, self.mask_token_id, self.eos_id = (self.ids[t] for t in SPECIALS)

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.ids})
        if unknown:
            raise ValueError(f"characters {unknown} are not in the arith vocabulary {''.join(CHARS)!r}")
        return [self.ids[c] for c in text]

    def decode(self, ids: Sequence[int] | Tensor, stop_at_eos: bool = True) -> str:
        """Text of `ids`; specials other than <eos> are written as their names, <eos> ends the text."""
        out = []
        for i in (ids.tolist() if isinstance(ids, Tensor) else ids):
            tok = self.vocab[i] if 0 <= i < len(self.vocab) else "<unk>"
            if tok == EOS and stop_at_eos:
                break
            out.append(tok)
        return "".join(out)


TOKENIZER = CharTokenizer()


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # a reference completion (sudoku: one solution; any valid one scores)


# ----------------------------------------------------------------------------------------- addition
def addition_problem(gen: torch.Generator, digits: int) -> Problem:
    hi = 10**digits
    a, b = (int(v) for v in torch.randint(hi, (2,), generator=gen))
    return Problem(f"{a:0{digits}d}+{b:0{digits}d}=", str(a + b))


# ------------------------------------------------------------------------------------------- sudoku
@lru_cache(maxsize=1)
def sudoku_solutions() -> tuple[str, ...]:
    """All 288 valid 4x4 sudoku grids, row-major strings of 16 digits."""
    rows = ["".join(p) for p in itertools.permutations("1234")]
    grids = []
    for r in itertools.product(rows, repeat=4):
        g = "".join(r)
        if all(sudoku_units_ok(g)):
            grids.append(g)
    return tuple(grids)


SUDOKU_UNITS = (
    [[r * 4 + c for c in range(4)] for r in range(4)]
    + [[r * 4 + c for r in range(4)] for c in range(4)]
    + [[(br + r) * 4 + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]
)


def sudoku_units_ok(grid: str) -> list[bool]:
    """For each of the 12 units (4 rows, 4 columns, 4 boxes): does it hold 1-4 once each?"""
    return [sorted(grid[i] for i in unit) == list("1234") for unit in SUDOKU_UNITS]


def sudoku_problem(gen: torch.Generator, blanks: int) -> Problem:
    sols = sudoku_solutions()
    sol = sols[int(torch.randint(len(sols), (1,), generator=gen))]
    hide = set(torch.randperm(16, generator=gen)[:blanks].tolist())
    cells = "".join("0" if i in hide else ch for i, ch in enumerate(sol))
    return Problem("|".join(cells[r * 4:(r + 1) * 4] for r in range(4)) + "=", sol)


def parse_sudoku_prompt(prompt: str) -> str | None:
    """The 16 given cells ('0' = blank) of a sudoku prompt, or None if it is not one."""
    body = prompt.rstrip("=").replace("|", "")
    return body if len(body) == 16 and all(c in "01234" for c in body) else None


# ------------------------------------------------------------------------------------------ encoding
@dataclass(frozen=True)
class ArithTask:
    """One task's problem distribution and the fixed prompt / completion lengths it encodes to."""

    task: Task = "addition"
    digits: int = 2  # addition: operand width
    blanks: int = 6  # sudoku: hidden cells
    gen_length: int = 4  # completion tokens (answer, then <eos>)

    @property
    def prompt_length(self) -> int:
        return 2 * self.digits + 2 if self.task == "addition" else 20

    def __post_init__(self) -> None:
        need = self.digits + 1 if self.task == "addition" else 16
        if self.gen_length < need:
            raise ValueError(f"gen_length={self.gen_length} is shorter than the longest {self.task} answer ({need})")

    def problem(self, seed: int, index: int) -> Problem:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return addition_problem(gen, self.digits) if self.task == "addition" else sudoku_problem(gen, self.blanks)

    def problems(self, seed: int, indices: Sequence[int]) -> list[Problem]:
        return [self.problem(seed, i) for i in indices]

    def encode_prompts(self, problems: Sequence[Problem], codec=TOKENIZER) -> Tensor:
        """[N, P] token ids (a real model's tokenizer may give prompts of different lengths: left-padded)."""
        rows = [codec.encode(p.prompt) for p in problems]
        width = max(len(r) for r in rows)
        return torch.tensor([[codec.pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long)

    def encode_completions(self, problems: Sequence[Problem], codec=TOKENIZER) -> Tensor:
        """[N, gen_length] token ids: the reference answer then <eos>."""
        rows = []
        for p in problems:
            ids = codec.encode(p.answer)[: self.gen_length]
            rows.append(ids + [codec.eos_id] * (self.gen_length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)
