"""Mapping types of DNNFusion (§3.1, Table 2) and the fusion table (§3.2, Table 3).

The enum is ordered by increasing complexity, the paper's footnote order, so "the more complex
mapping type" of two is simply their maximum.
"""
from __future__ import annotations

from enum import Enum, IntEnum


class MappingType(IntEnum):
    ONE_TO_ONE = 0
    REORGANIZE = 1
    SHUFFLE = 2
    ONE_TO_MANY = 3
    MANY_TO_MANY = 4

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    MappingType.ONE_TO_ONE: "One-to-One",
    MappingType.REORGANIZE: "Reorganize",
    MappingType.SHUFFLE: "Shuffle",
    MappingType.ONE_TO_MANY: "One-to-Many",
    MappingType.MANY_TO_MANY: "Many-to-Many",
}


class Verdict(Enum):
    """Table 3's colours: green fuses directly, yellow needs a latency comparison, red never fuses."""

    GREEN = "green"
    YELLOW = "yellow"
    RED = "red"


O2O, REO, SHU, O2M, M2M = (
    MappingType.ONE_TO_ONE,
    MappingType.REORGANIZE,
    MappingType.SHUFFLE,
    MappingType.ONE_TO_MANY,
    MappingType.MANY_TO_MANY,
)
G, Y, R = Verdict.GREEN, Verdict.YELLOW, Verdict.RED

# FUSION_TABLE[first][second] = (mapping type of the fused op, verdict).
# Result types are Table 3's cells. Colours follow §3.2's text: One-to-One with anything is green;
# Reorganize/Shuffle with One-to-Many or Many-to-Many (either order) is yellow; Reorganize and
# Shuffle among themselves compose index maps and are green; One-to-Many followed by Many-to-Many
# and Many-to-Many followed by Many-to-Many are red; Many-to-Many followed by One-to-Many is yellow.
# One-to-Many followed by One-to-Many is yellow: it may replicate the first op's work.
FUSION_TABLE: dict[MappingType, dict[MappingType, tuple[MappingType, Verdict]]] = {
    O2O: {O2O: (O2O, G), O2M: (O2M, G), M2M: (M2M, G), REO: (REO, G), SHU: (SHU, G)},
    O2M: {O2O: (O2M, G), O2M: (O2M, Y), M2M: (M2M, R), REO: (O2M, Y), SHU: (O2M, Y)},
    M2M: {O2O: (M2M, G), O2M: (M2M, Y), M2M: (M2M, R), REO: (M2M, Y), SHU: (M2M, Y)},
    REO: {O2O: (REO, G), O2M: (O2M, Y), M2M: (M2M, Y), REO: (REO, G), SHU: (REO, G)},
    SHU: {O2O: (SHU, G), O2M: (O2M, Y), M2M: (M2M, Y), REO: (REO, G), SHU: (SHU, G)},
}


def fuse_types(first: MappingType, second: MappingType) -> tuple[MappingType, Verdict]:
    """The mapping type and verdict of fusing `first` with its consumer `second`."""
    return FUSION_TABLE[first][second]
