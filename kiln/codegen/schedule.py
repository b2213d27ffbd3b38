"""Schedule parameters of code generation: explicit, with defaults, recorded in `Kernel.schedule`.

A tuner varies these per block (`generate(..., block_schedules={block_id: {...}})`); the defaults are
chosen for 2–16 core CPUs with 128–512-bit vectors and 1–2 MB of L2.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from kiln.codegen.microkernel import tile_for
from kiln.target import DeviceLimits

# A GPU work-item's register tiles (rows × columns), largest first; columns in whole 4-lane vectors.
GPU_REGISTER_TILES = ((8, 8), (4, 8), (4, 4), (2, 4), (1, 4))


@dataclass(frozen=True)
class Schedule:
    # Parallelism: a stage runs on one thread below this much work (elements × phases), and the
    # parallel loop collapses nested loops until it has at least this many iterations.
    parallel_min_work: int = 1 << 15
    parallel_min_iterations: int = 64
    # Loop splitting: split an inner loop whose index maps divide its variable (removes div/mod).
    split_loops: bool = True
    # MatMul/Gemm/Einsum/implicit-GEMM contractions: output tiles of rows × columns, each with its
    # accumulators on the stack (32 × 64 floats: 8 KiB, in L1) and run by one thread; each B
    # element is read once per row tile.
    matmul_tile_m: int = 32
    matmul_tile_n: int = 64
    # Convolution: convs with at least this many output channels per group run as an implicit
    # GEMM (vectorised over output channels); smaller ones (depthwise) as direct loops with blocks
    # of `conv_tile_cout` output channels (each input row is reused that many times) and output
    # rows tiled by `conv_tile_w`.
    conv_gemm_min_cout: int = 16
    # GEMM-sized 3×3 stride-1 convs on images of at least a micro-kernel panel of 2×2 tiles run
    # as Winograd F(2×2, 3×3) (kiln.codegen.ops.conv_winograd); False: as direct convs.
    conv_winograd: bool = True
    conv_tile_cout: int = 4
    conv_tile_w: int = 256
    # Packed GEMM (every contraction of at least `gemm_min_m` rows × `gemm_min_n` columns, convs
    # included): a register-blocked micro-kernel of `gemm_mr` rows × `gemm_nr` columns
    # (0: chosen from the target's vector width, see `kiln.codegen.microkernel`) over packed
    # operands; cache blocks of `gemm_mc` rows × `gemm_nc` columns × `gemm_kc` of the sum, one
    # block per parallel task. `vector_bytes` 0 means the target's widest vector.
    gemm_min_m: int = 4
    gemm_min_n: int = 8  # narrower products (a matrix-vector one) run as dot products
    gemm_mr: int = 0
    gemm_nr: int = 0
    # 216 rows: a transformer's 128–197 activation rows in one block, so each block of weights
    # (cold in a model: megabytes since their last use) is read once (2-core AVX-512 Xeon,
    # interleaved in-model A/B: 144 against 96, DistilBERT 0.94×, ResNet-50 0.95×, ViT-B and
    # Swin-T 0.97×, ConvNeXt-T 1.00×; 216 against 144, ViT-B 0.97×, Swin-T 0.99×, MobileNetV2,
    # EfficientNet-B0 and ConvNeXt-T 0.99–1.00×)
    gemm_mc: int = 216
    gemm_nc: int = 256
    gemm_kc: int = 256
    # The packed GEMM's slice of the sum grows past `gemm_kc` (an even split of K) while a task's
    # blocks of A and B fit in this much cache together (a core's L2); 0: exactly `gemm_kc`
    gemm_l2_bytes: int = 1 << 20
    vector_bytes: int = 0
    # Grain of the packed-GEMM and conv task loops (`kiln.codegen.ir.GRAINS`; the name is the
    # tuner's key): "static" (grain "even") splits them evenly up front, each thread a run of
    # column blocks (pixels) as in the kernels around it, so what a thread reads is mostly what it
    # wrote; "dynamic" (grain "one") hands out tasks as threads free up. On a 2-vCPU Zen 4 VM
    # whose vCPUs sat on distant cores for much of the time (a cache line's round trip 340 ns
    # instead of 55), ResNet-50 took 45.5 ms static against 48.1 dynamic there, 38.1 against 37.8
    # with the vCPUs close; EfficientNet-B0 11.4 against 13.1 (far), 11.1 against 11.0 (near);
    # ConvNeXt-T, Swin-T, DistilBERT 0.97-0.99x (far), MobileNetV2 the same.
    gemm_omp_schedule: str = "static"
    # AGO's intensive fusion (`kiln.codegen.intensive`): a conv → depthwise or pointwise conv pair
    # of a block runs as one stage, tile by tile, each tile's intermediate in a stack buffer of at
    # most `intensive_tile_bytes` (a quarter of a 1 MiB L2); off: two stages, a full intermediate.
    intensive_fusion: bool = True
    intensive_tile_bytes: int = 1 << 18
    # An attention chain as one stage (`kiln.codegen.ops.fused_attention`), its tiles in local
    # arrays; off: the chain's ops as ordinary stages.
    fused_attention: bool = True
    # FusionStitching's blocks (`kiln.plan.stitch_schedule`): 0 leaves each memory-bound stage's
    # parallel loop to its own grain; n > 0 splits every such loop of the kernel into n equal
    # chunks handed out statically (chunk k to thread k mod threads), so that the stages of a
    # stitched kernel agree on how work is split: a thread reads back from scratch the rows it
    # wrote itself, from its own L1/L2, as a GPU thread block reads its shared memory.
    stitch_blocks: int = 0
    # 0: the blocks are Row blocks (above). C > 0: a Column schedule (`kiln.codegen.columns`):
    # the C columns (the contiguous inner elements from the schedule's split_dim on) are cut into
    # `stitch_blocks` contiguous chunks, and every stage that can runs its rows inside its
    # thread's chunk, vectorised along the columns.
    stitch_columns: int = 0
    # Work-group tiling of GEMMs on GPUs (`kiln.codegen.gemm.group`): 0 leaves it off (CPUs); n > 0:
    # every packed GEMM runs in work-groups of at most n work-items, which stage slices of A and
    # B in at most `gemm_local_bytes` of local memory, each work-item a register tile of them.
    # A GPU backend fills both (and the register tile) from its target's `DeviceLimits`.
    gemm_work_group: int = 0
    gemm_local_bytes: int = 0

    @property
    def task_grain(self) -> str:
        """The grain of the GEMM and conv task loops that `gemm_omp_schedule` asks for."""
        return "one" if self.gemm_omp_schedule == "dynamic" else "even"

    @property
    def stitch_type(self) -> str:
        """FusionStitching's sched_type this kernel runs with: "row", "column" or "none"."""
        if self.stitch_blocks <= 0:
            return "none"
        return "column" if self.stitch_columns > 0 else "row"

    def merged(self, overrides: Mapping[str, Any] | None) -> Schedule:
        if not overrides:
            return self
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown schedule parameter(s): {', '.join(unknown)}")
        return replace(self, **overrides)

    def for_device(self, limits: DeviceLimits) -> Schedule:
        """Work-group tiling sized for a GPU's limits (fields already set are kept): at most its
        largest work-group, its local memory, and a register tile (`gemm_mr` × `gemm_nr`) whose
        accumulators, one row of B and one column of A fit its registers per work-item."""
        mr, nr = self.gemm_mr, self.gemm_nr
        if not (mr and nr):
            mr, nr = next(((m, n) for m, n in GPU_REGISTER_TILES
                           if m * n + m + n <= limits.registers), GPU_REGISTER_TILES[-1])
        return replace(self, gemm_work_group=self.gemm_work_group or limits.max_work_group,
                       gemm_local_bytes=self.gemm_local_bytes or limits.fast_memory_bytes,
                       gemm_mr=mr, gemm_nr=nr)

    def for_isa(self, isa: tuple[str, ...]) -> Schedule:
        """The micro-kernel shape and vector width made explicit for a target's ISA features."""
        uk = tile_for(isa, "float32", self.vector_bytes, self.gemm_mr, self.gemm_nr)
        return replace(self, vector_bytes=uk.vector_bytes, gemm_mr=uk.mr, gemm_nr=uk.nr)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_SCHEDULE = Schedule()
