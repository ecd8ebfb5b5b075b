"""Out-of-memory splitting: a piece whose forward does not fit is cut into halves (recursively, down to one
sample) and its parts back-propagated one by one, so the optimisation step's gradient is the unsplit one (to
float summation order).

Triggers, both in a piece's forward and loss (before anything of it is back-propagated):
  * a real out-of-memory error (`torch.OutOfMemoryError`, a RuntimeError saying "out of memory", the host
    allocator's "can't allocate memory"); the failed forward's graph is collected and the CUDA cache emptied;
  * `learner.activation_memory_cap_mb`: the live bytes of the tensors autograd keeps for the backward, measured
    while the piece is built (`SavedTensorMeter`: distinct storages, the parameters' and buffers' excluded --
    under ZeRO-3 a gathered parameter counts), past the cap `ActivationCapExceeded` stops the forward.

A part is the piece's rows `part` (`TermProducer.piece(key, part)`): every random draw of the step was made
before, so the parts' terms are the whole piece's. Loss terms are sums over rows divided by whole-step
normalisers, so the parts' losses sum to the piece's; the statistics an objective takes over a piece
(`Objective.piece_statistics`: d1's token count, GARDO's gated count, a local self-normalisation's sum) are
summed over the parts in a no-grad pass first and handed to each part (`TermInputs.piece`); an objective with
a piece statistic that is not such a sum refuses the split (`Objective.split_refusal`, naming the setting).
The part size that worked is remembered for the rest of the update (`memory/piece_size_min`).

Ranks split on their own, exactly, where they communicate at the optimiser step only (ZeRO 0-1); ZeRO 2-3
communicate in every pass, so with several ranks a split is refused there. An out-of-memory error in the
backward cannot be split (the piece's gradient is already partly accumulated): it is re-raised naming the
settings that avoid it. The no-grad passes (the recompute of the old policy, `prepare`, the sequence path's
ell_bar) keep whole micro-batches: they save nothing for a backward, and the old log-probs stay the values
an unsplit update uses.
"""
from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn

from steadyrl.trainer.objectives import Objective, TermInputs

MB = 2**20
CAP_FIELD = "learner.activation_memory_cap_mb"


class ActivationCapExceeded(RuntimeError):
    """The tensors saved for the backward passed `learner.activation_memory_cap_mb`."""


def is_out_of_memory(err: BaseException) -> bool:
    """A real out-of-memory error: the accelerator's (`torch.OutOfMemoryError`, "CUDA out of memory") or the host
    allocator's ("DefaultCPUAllocator: can't allocate memory")."""
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))


class _Saved:
    """A tensor autograd saved for the backward; releases its storage's count in the meter when freed."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: Tensor, meter: "SavedTensorMeter", key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter.release(self.key)


class SavedTensorMeter:
    """Live bytes of the distinct storages autograd saves for the backward (`bytes`, peak `peak`), excluding
    `skip` (the storages of the parameters and buffers); raises `ActivationCapExceeded` past `cap` bytes."""

    def __init__(self, cap: float, skip: set[int]):
        self.cap, self.skip = cap, skip
        self.live: dict[int, list[int]] = {}  # storage -> [saved references, bytes]
        self.bytes = self.peak = 0

    def pack(self, t: Tensor) -> Tensor | _Saved:
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no plain storage (e.g. a tensor subclass): its own bytes
            key, size = id(t), t.numel() * t.element_size()
        if key in self.skip or size == 0:
            return t
        entry = self.live.get(key)
        if entry is not None:
            entry[0] += 1
        else:
            if self.bytes + size > self.cap:
                raise ActivationCapExceeded(f"tensors saved for the backward would reach {(self.bytes + size) / MB:.3f}"
                                            f" MB > {CAP_FIELD}={self.cap / MB:g}")
            self.live[key] = [1, size]
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
        return _Saved(t.detach(), self, key)  # detached: the holder keeps no graph alive (no reference cycle)

    def release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[key]

    @staticmethod
    def unpack(saved: Tensor | _Saved) -> Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    @contextmanager
    def active(self) -> Iterator["SavedTensorMeter"]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


def model_storages(module: nn.Module) -> set[int]:
    """Storage addresses of a module's parameters and buffers (not activations: never counted)."""
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


def halves(rows: Tensor, limit: int) -> list[Tensor]:
    """`rows` cut into halves, recursively, until each part has at most `limit` rows (first half the larger)."""
    if len(rows) <= limit:
        return [rows]
    first, second = rows.tensor_split(2)
    return halves(first, limit) + halves(second, limit)


class PieceSplitter:
    """Runs one piece (forward, loss, backward), splitting it when it does not fit (module docstring); keeps the
    update's split statistics."""

    def __init__(self, cap_mb: float | None, models: list[nn.Module], collective_backward: bool = False):
        """`collective_backward`: the backward passes run collectives (ZeRO 2-3 over several ranks), so a rank
        must not split alone: a split is refused there."""
        self.cap = None if cap_mb is None else cap_mb * MB
        self.models = models
        self.collective_backward = collective_backward
        self.start_update()

    def start_update(self) -> None:
        """A new update: forget the remembered part size (memory needs may differ) and the statistics."""
        self.limit: int | None = None  # rows per part that fitted; None: whole pieces
        self.splits = 0  # times a piece or part did not fit and was halved, in this update
        self.pieces_split = 0  # pieces back-propagated in parts, in this update
        self.peak_bytes = 0  # the largest measured piece or part that fitted (with a cap)

    def metrics(self) -> dict[str, float]:
        out = {"memory/splits": float(self.splits), "memory/pieces_split": float(self.pieces_split)}
        if self.limit is not None:
            out["memory/piece_size_min"] = float(self.limit)
        if self.cap is not None:
            out["memory/activation_mb_max"] = self.peak_bytes / MB
        return out

    def run(self, build: Callable[[Tensor | None], TermInputs], rows: int, objective: Objective,
            stats: dict[str, Tensor], backward: Callable[[Tensor, bool], None]) -> list[dict[str, Tensor]]:
        """Back-propagate the piece of `rows` rows that `build(part)` makes (part None: whole); `backward(loss,
        last_part)`. Returns the metrics of each part back-propagated."""
        everything = torch.arange(rows)
        parts = [everything] if self.limit is None or rows <= self.limit else halves(everything, self.limit)
        piece: dict[str, Tensor] | None = None
        metrics = []
        while parts:
            part = parts[0]
            whole = len(part) == rows
            if not whole and piece is None:  # the first split of this piece: nothing of it back-propagated yet
                piece = self._piece_statistics(build, parts, objective)
            loss, m, failure = self._forward(build, None if whole else part, piece, objective, stats)
            if failure is not None:
                self._lower_limit(part, failure, objective)
                parts = [half for p in parts for half in halves(p, self.limit)]  # the pending parts too
                continue
            try:
                backward(loss, len(parts) == 1)
            except RuntimeError as err:
                if is_out_of_memory(err):
                    raise RuntimeError(f"out of memory in the backward of a piece of {len(part)} samples: its "
                                       "gradient is partly accumulated, so it cannot be split; set "
                                       f"{CAP_FIELD} (a split before the backward, measured in the forward) or a "
                                       "smaller learner.micro_batch_size") from err
                raise
            del loss
            metrics.append(m)
            parts.pop(0)
        self.pieces_split += piece is not None
        return metrics

    def _forward(self, build: Callable[[Tensor | None], TermInputs], part: Tensor | None,
                 piece: dict[str, Tensor] | None, objective: Objective,
                 stats: dict[str, Tensor]) -> tuple[Tensor | None, dict[str, Tensor], str | None]:
        """(loss, metrics, None) of the piece or part, or (None, {}, why) when it does not fit."""
        meter = None if self.cap is None else SavedTensorMeter(self.cap, self._skip())
        try:
            with meter.active() if meter is not None else nullcontext():
                inputs = build(part)
                inputs.piece = piece
                loss, m = objective.piece_loss(inputs, stats)
        except ActivationCapExceeded as err:
            return None, {}, str(err)
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            why = f"out of memory: {str(err).splitlines()[0]}"
        else:
            if meter is not None:
                self.peak_bytes = max(self.peak_bytes, meter.peak)
            return loss, m, None
        gc.collect()  # the failed forward's partial graph (held by the traceback's frames) goes now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, {}, why

    def _lower_limit(self, part: Tensor, why: str, objective: Objective) -> None:
        """`part` did not fit: the limit becomes its half; refuses where it cannot be split exactly or is one
        sample."""
        if len(part) == 1:
            raise MemoryError(f"one sample does not fit ({why}): raise {CAP_FIELD} (or free memory: a smaller "
                              "model, LoRA, a lower resolution)")
        refusal = objective.split_refusal()
        if self.collective_backward:
            refusal = ("learner.zero_stage >= 2 with learner.ranks > 1 runs collectives in every forward or backward "
                       "pass, and a rank that splits alone would run more of them than the others (zero_stage 0 or 1 "
                       "communicate at the optimiser step only)")
        if refusal is not None:
            raise MemoryError(f"a piece of {len(part)} samples does not fit ({why}) and cannot be split exactly: "
                              f"{refusal}; use a smaller learner.micro_batch_size, or raise {CAP_FIELD}")
        self.splits += 1
        size = math.ceil(len(part) / 2)
        self.limit = size if self.limit is None else min(self.limit, size)

    def _piece_statistics(self, build: Callable[[Tensor | None], TermInputs], parts: list[Tensor],
                          objective: Objective) -> dict[str, Tensor]:
        """The objective's piece statistics of the whole piece: summed over `parts` (a partition of it), no
        gradient. Objectives without any skip the pass."""
        if type(objective).piece_statistics is Objective.piece_statistics:
            return {}
        total: dict[str, Tensor] = {}
        with torch.no_grad():
            for part in parts:
                for k, v in objective.piece_statistics(build(part)).items():
                    total[k] = total[k] + v if k in total else v
        return total

    def _skip(self) -> set[int]:
        return set().union(*(model_storages(m) for m in self.models))
