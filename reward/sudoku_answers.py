"""NxN sudoku (4x4, 9x9): the completion keeps the givens and fills a valid grid; d1's partial credit."""

from __future__ import annotations

import re
from functools import lru_cache

from steadyrl.reward.math_answers import MAX_COMPLETION_CHARS, last_boxed, last_tag


def _sudoku_size(puzzle: str) -> tuple[int, int]:
    """(N, box side) for a puzzle of N*N cells with N = box^2 (4x4, 9x9); ValueError otherwise."""
    for box in (2, 3):
        if len(puzzle) == box ** 4:
            return box * box, box
    raise ValueError(f"a sudoku puzzle must have 16 (4x4) or 81 (9x9) cells, got {len(puzzle)}: {puzzle!r}")


@lru_cache(maxsize=16)
def _units(n: int, box: int) -> tuple[tuple[int, ...], ...]:
    rows = [tuple(r * n + c for c in range(n)) for r in range(n)]
    cols = [tuple(r * n + c for r in range(n)) for c in range(n)]
    boxes = [tuple((br + r) * n + bc + c for r in range(box) for c in range(box))
             for br in range(0, n, box) for bc in range(0, n, box)]
    return tuple(rows + cols + boxes)


def _check_puzzle(puzzle: str | int) -> tuple[str, int, int]:
    puzzle = str(puzzle).strip()
    n, box = _sudoku_size(puzzle)
    if any(not ("0" <= c <= str(n)) for c in puzzle):
        raise ValueError(f"a {n}x{n} sudoku puzzle holds digits 0-{n} (0 = blank), got {puzzle!r}")
    return puzzle, n, box


def sudoku_valid(grid: str, puzzle: str) -> bool:
    """Does `grid` (N*N digits) keep every given of `puzzle` and hold 1..N once in each row, column, box?"""
    puzzle, n, box = _check_puzzle(puzzle)
    if len(grid) != n * n or any(g != "0" and g != c for g, c in zip(puzzle, grid)):
        return False
    digits = sorted(str(d) for d in range(1, n + 1))
    return all(sorted(grid[i] for i in unit) == digits for unit in _units(n, box))


@lru_cache(maxsize=1024)
def solve_sudoku(puzzle: str, limit: int = 1) -> tuple[str, ...]:
    """Up to `limit` solutions of `puzzle` (backtracking on the most constrained blank first)."""
    puzzle, n, box = _check_puzzle(puzzle)
    units = _units(n, box)
    peers = [set().union(*(u for u in units if i in u)) - {i} for i in range(n * n)]
    grid, found = list(puzzle), []

    def search() -> None:
        best, best_options = -1, None
        for i, c in enumerate(grid):
            if c == "0":
                options = [d for d in map(str, range(1, n + 1)) if all(grid[p] != d for p in peers[i])]
                if best_options is None or len(options) < len(best_options):
                    best, best_options = i, options
                    if len(options) <= 1:
                        break
        if best_options is None:
            found.append("".join(grid))
            return
        for d in best_options:
            grid[best] = d
            search()
            if len(found) >= limit:
                break
        grid[best] = "0"

    givens_consistent = all(len(g) == len(set(g)) for g in ([puzzle[i] for i in u if puzzle[i] != "0"] for u in units))
    if givens_consistent:
        search()
    return tuple(found)


def extract_sudoku_digits(completion: str) -> str:
    """The ASCII digits of the last <answer>...</answer>, else of the last \\boxed{}, else of the text."""
    text = completion[-MAX_COMPLETION_CHARS:]
    for found in (last_tag(text, "answer"), last_boxed(text)):
        if found is not None:
            return "".join(re.findall(r"[0-9]", found))
    return "".join(re.findall(r"[0-9]", text))


def verify_sudoku(completion: str, puzzle: str, solution: str | None = None, partial_credit: bool = False) -> float:
    """1.0 if the first N*N digits of the completion (extract_sudoku_digits) keep every given of `puzzle`
    (N*N digits row-major, 0 = blank; 4x4 or 9x9) and fill a valid grid, else 0.0 (fewer than N*N
    digits: 0.0). partial_credit (d1's rule, for an invalid grid): the digits padded with '0' / cut to
    N*N, the share of the puzzle's blanks holding `solution`'s digit there (`solution` defaults to the
    puzzle's first solution found by backtracking; a puzzle without blanks scores 0, as in d1)."""
    puzzle, n, _ = _check_puzzle(puzzle)
    if partial_credit:
        if solution is None:
            solutions = solve_sudoku(puzzle)
            if not solutions:
                raise ValueError(f"sudoku puzzle {puzzle!r} has no solution")
            solution = solutions[0]
        elif len(str(solution)) != n * n:
            raise ValueError(f"sudoku solution {solution!r} does not have {n * n} digits")
        solution = str(solution)
    try:
        digits = extract_sudoku_digits(completion)
        if len(digits) >= n * n and sudoku_valid(digits[:n * n], puzzle):
            return 1.0
        if not partial_credit:
            return 0.0
        grid = (digits + "0" * (n * n))[:n * n]
        blanks = [i for i, c in enumerate(puzzle) if c == "0"]
        return sum(grid[i] == solution[i] for i in blanks) / len(blanks) if blanks else 0.0
    except Exception:  # noqa: BLE001 - model output never raises
        return 0.0
