"""Placing buffers with lifetimes in one region so that buffers live at the same time never share
bytes and dead ones give their space to later ones: the arena of a model's intermediate results
(`kiln.runtime.memory`, lifetimes in kernels) and the scratch area of one kernel
(`kiln.codegen.lower`, lifetimes in stages)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ALIGNMENT = 64


def align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class ArenaBuffer:
    tensor: str
    offset: int
    nbytes: int
    first: int  # first step (kernel or stage) that writes it
    last: int  # last step that reads it (= first if none does)

    def overlaps_in_time(self, other: ArenaBuffer) -> bool:
        return self.first <= other.last and other.first <= self.last

    def overlaps_in_space(self, other: ArenaBuffer) -> bool:
        return self.offset < other.offset + other.nbytes and other.offset < self.offset + self.nbytes


def place(intervals: Iterable[tuple[str, int, int, int]]) -> list[ArenaBuffer]:
    """Offsets for (tensor, nbytes, first, last) so no two buffers live at once share bytes.

    Largest first; each goes to the smallest gap that fits among the placed buffers whose
    lifetimes overlap its own, else above the highest of them.
    """
    placed: list[ArenaBuffer] = []
    for tensor, nbytes, first, last in sorted(intervals, key=lambda v: (-v[1], v[2], v[0])):
        probe = ArenaBuffer(tensor, 0, nbytes, first, last)
        live = sorted((b for b in placed if b.nbytes and b.overlaps_in_time(probe)),
                      key=lambda b: b.offset)
        placed.append(ArenaBuffer(tensor, _best_fit(live, nbytes), nbytes, first, last))
    return sorted(placed, key=lambda b: (b.first, b.tensor))


def _best_fit(live: list[ArenaBuffer], nbytes: int) -> int:
    best: tuple[int, int] | None = None  # (gap size, offset)
    cursor = 0
    for b in live:
        gap = b.offset - cursor
        if gap >= nbytes and (best is None or gap < best[0]):
            best = (gap, cursor)
        cursor = max(cursor, align(b.offset + b.nbytes))
    return best[1] if best else cursor
