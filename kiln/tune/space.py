"""The per-block schedule search space: genes over `kiln.codegen.schedule.Schedule` parameters.

A gene is one decision with a few alternatives; each alternative is a dict of Schedule overrides
chosen together (a micro-kernel shape and its vector width only make sense as a pair). The space
of a block keeps only the genes that matter for it: a gene is relevant when one of its
alternatives changes the block's generated C source (code generation is cheap, a few ms per
block; measuring is not). Which genes are offered depends on the block's stages:

* contractions and implicit-GEMM convolutions: micro-kernel shape × vector width (within the
  register file), cache blocks mc / nc / kc and the cache the slice of the sum may grow
  into (`gemm_l2_bytes`), the thread pool's schedule of the task loop, and the
  output tile of the unpacked (`ikj`) path;
* direct convolutions (depthwise): output-channel block and row tile, and the algorithm switch
  (implicit GEMM or direct loops);
* pairs fused by AGO's intensive fusion (conv pairs, matrix-product pairs): on or off, and the
  tile's byte budget (larger tiles pay for matrix-product pairs, whose weights stream through
  the cache once per tile);
* every block: when a stage goes parallel and how many iterations its parallel loop collapses,
  and loop splitting (the memory-bound stages' only knobs).

`QUICK` lists the fixed candidates of `--tune quick`, most promising first.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.codegen import Kernel
from kiln.codegen.microkernel import fits_registers
from kiln.target import Target

Overrides = dict[str, Any]

def micro_kernel_shapes(target: Target, dtype_bytes: int = 4) -> list[Overrides]:
    """(vector width, mr, nr) choices that fit the register file: mr·nr/lanes accumulators +
    nr/lanes B vectors + 1 broadcast ≤ registers; widths up to the target's widest."""
    shapes: list[Overrides] = []
    widest = target.vector_bytes
    for vb in (64, 32, 16):
        if vb > widest:
            continue
        lanes = vb // dtype_bytes
        for vectors in (1, 2, 3, 4):
            nr = vectors * lanes
            for mr in (4, 6, 8, 12, 14):
                if fits_registers(vb, mr * vectors, vectors) and mr * vectors >= 8:
                    shapes.append({"vector_bytes": vb, "gemm_mr": mr, "gemm_nr": nr})
    return shapes


@dataclass(frozen=True)
class Gene:
    name: str
    alternatives: tuple[Overrides, ...]  # the first is the default: no overrides


def genes(target: Target) -> tuple[Gene, ...]:
    return (
        Gene("micro_kernel", ({}, *micro_kernel_shapes(target))),
        Gene("gemm_mc", ({}, *({"gemm_mc": v} for v in (48, 72, 96, 144, 288)))),
        Gene("gemm_nc", ({}, *({"gemm_nc": v} for v in (128, 192, 384, 512, 1024)))),
        Gene("gemm_kc", ({}, *({"gemm_kc": v} for v in (128, 192, 384, 512, 768)))),
        Gene("gemm_l2_bytes", ({}, *({"gemm_l2_bytes": v} for v in (0, 1 << 19, 1 << 21)))),
        Gene("gemm_omp_schedule", ({}, {"gemm_omp_schedule": "dynamic"})),
        Gene("matmul_tile", ({}, *({"matmul_tile_m": m, "matmul_tile_n": n}
                                   for m in (8, 16, 32, 64) for n in (32, 64, 128, 256)
                                   if (m, n) != (32, 64)))),
        Gene("conv_algorithm", ({}, {"conv_gemm_min_cout": 8}, {"conv_gemm_min_cout": 1 << 30},
                                {"conv_winograd": False})),
        Gene("conv_tile", ({}, *({"conv_tile_cout": c, "conv_tile_w": w}
                                 for c in (2, 4, 8) for w in (64, 256, 1024) if (c, w) != (4, 256)))),
        Gene("parallel_min_work", ({}, *({"parallel_min_work": v} for v in (1 << 12, 1 << 18, 1 << 22)))),
        Gene("parallel_min_iterations", ({}, *({"parallel_min_iterations": v} for v in (8, 16, 256)))),
        Gene("split_loops", ({}, {"split_loops": False})),
        Gene("intensive", ({}, {"intensive_fusion": False},
                           *({"intensive_tile_bytes": v}
                             for v in (1 << 15, 1 << 16, 1 << 17, 1 << 19, 1 << 20)))),
    )


# `--tune quick`: a fixed list of overrides tried on every block (the ones that do not change its
# source are dropped), most promising first; at most QUICK_MAX distinct kernels per block.
QUICK: tuple[Overrides, ...] = (
    {},
    {"gemm_omp_schedule": "dynamic"},
    {"gemm_mc": 48, "gemm_nc": 128},
    {"gemm_mc": 192, "gemm_nc": 512, "gemm_kc": 384},
    {"matmul_tile_m": 16, "matmul_tile_n": 128},
    {"matmul_tile_m": 64, "matmul_tile_n": 64},
    {"conv_gemm_min_cout": 1 << 30},
    {"intensive_fusion": False},  # AGO's intensive fusion against two stages (`kiln.codegen.intensive`)
    {"parallel_min_work": 1 << 12},
    {"parallel_min_work": 1 << 18},
)
QUICK_MAX = 5


_NAMES = re.compile(r"\b(?:t\d+|k\d+_[A-Za-z0-9_]*)\b")


def kernel_hash(kernel: Kernel) -> str:
    """A hash of the kernel's C source with Kiln's tensor ids and kernel symbols renumbered in
    order of appearance and its comment header dropped: equal for the same code made for the same
    block in another place (another layer, another model), different whenever the code differs."""
    body = kernel.source.split("\n", 1)[1] if kernel.source.startswith("/*") else kernel.source
    names: dict[str, str] = {}
    text = _NAMES.sub(lambda m: names.setdefault(m.group(0), f"n{len(names)}"), body)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def merge(parts: Sequence[Mapping[str, Any]]) -> Overrides:
    out: Overrides = {}
    for p in parts:
        out.update(p)
    return out
