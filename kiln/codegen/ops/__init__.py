"""Per-op lowerings, registered next to their code (one module per op family).

Three kinds, following the mapping types:

* `inline` — One-to-One, Reorganize, Shuffle and One-to-Many ops: the value of one output element
  as an expression of input elements at mapped indices. These never get a loop of their own; the
  stage that needs their value evaluates them where it reads them.
* `row` — reductions and normalisations over some axes (Many-to-Many, one-relies-on-many): a list
  of reduction phases per row plus per-row and per-element results. Several row ops over the same
  rows share one multi-phase loop (Souffle's two-phase reduction, generalised).
* `stage` — every other Many-to-Many op (MatMul, Conv, pooling, scans, recurrences, ...): a
  function that writes its own loop nest and hands each result element to the block's epilogue.

A lowering may also declare `check(op, graph) -> reason | None` for variants it does not handle.

Importing this package imports every family, so its `lowering` and `registered` see them all;
the decorators and the lookup live in `kiln.codegen.ops.registry`, which op modules import.
"""
from __future__ import annotations

from kiln.codegen.ops import (  # noqa: F401  (each module registers its ops)
    attention,
    contraction,
    conv,
    elementwise,
    losses,
    movement,
    quantized,
    recurrent,
    resize,
    rotary,
    rows,
    scan,
    scatter,
    signal,
)
from kiln.codegen.ops.registry import OpLowering as OpLowering
from kiln.codegen.ops.registry import lowering as lowering
from kiln.codegen.ops.registry import registered as registered
