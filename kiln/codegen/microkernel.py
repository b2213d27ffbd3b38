"""Register-blocked GEMM micro-kernels: their shapes per ISA, and their source as portable C with
GCC vector extensions (the C backend's micro-kernel provider; another backend brings its own).

One generator serves every ISA: a micro-kernel updates an `mr` × `nr` tile of C held in
`mr · nr / lanes` vector registers, for `kc` steps of the sum, from packed operands:

* A panel: `kc` × `mr`, row index fastest (`a[k·mr + r]`), broadcast one scalar at a time; or,
  for a kernel with a nonzero `lda`, A's rows read in place (`a[r·lda + k]`: a row-major operand
  needs no packing, the broadcasts read its rows wherever they are); or, for a kernel with a
  nonzero `a_step`, A's columns read in place (`a[k·a_step + r]`: a column-major operand, such as
  attention's V read as Vᵀ, is a panel whose steps lie `a_step` apart);
* B panel: `kc` rows of `nr` contiguous columns, `ldb` apart (`b[k·ldb + c]`: `ldb = nr` for a
  packed panel, the padded row length for a row-major operand), loaded as `nr / lanes` vectors;
* C tile: row-major with leading dimension `ldc`, loaded (when `accumulate`) and stored once.

An *indirect* micro-kernel reads B row k at `b + rows[k]` instead of `b + k·ldb`: a table of row
offsets (int32) computed at compile time. A direct convolution uses it to read each (input channel,
kernel tap) row of its B operand straight from the zero-padded input, shifted by the tap's offset,
with no im2col copy (`kiln.codegen.ops.conv_direct`). A *pixel-rows* kernel is its mirror: A row r
(an output pixel) reads element k at `a + bases[r] + rows[k]` (two int32 tables, the pixel's
position and the tap's offset in the padded input), B is a packed panel of weights (output
channels in the lanes), and the finished tile is stored transposed, element (r, j) at
`out[j·ldc + r]` (`kiln.codegen.ops.conv_pixels`).

The compiler turns `acc += a * b` on vector types into FMA instructions of the target: AVX-512
(zmm, 16 lanes) or AVX2 (ymm, 8 lanes) on x86-64, NEON (4 lanes) on aarch64. The tile shape fills
the register file: accumulators + B vectors + one broadcast ≤ the number of vector registers.
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

# (vector bytes, mr, nr) per ISA, widest first: 32 zmm → 12×32 (24 accumulators); 16 ymm → 6×16
# (12 accumulators); 32 NEON q registers → 8×12 (24 accumulators).
ISA_TILES = (
    ("avx512f", 64, 12, 32),
    ("avx2", 32, 6, 16),
    ("neon", 16, 8, 12),
)
FALLBACK_TILE = (16, 4, 8)  # SSE-width vectors: every x86-64 and aarch64 CPU has them
# The L1 data cache of the CPUs the tiles are chosen for (Zen 4, recent Intel and Arm cores: 32 KiB
# or more, 8 ways or more): addresses L1_SET_SPAN apart share a set, L1_WAYS lines of a set fit.
L1_WAYS = 8
L1_SET_SPAN = 4096
# How many steps of the sum ahead a micro-kernel asks for B's rows: a packed panel of weights
# comes from memory on its first sweep, and the hardware prefetchers stop at each 4 KiB page.
PREFETCH_STEPS = 24
# The least share of a tile's accumulators a tile of a row fewer keeps (`padding_tiles`).
PADDING_TILE_CHAINS = 3 / 4
# Vector registers a micro-kernel may fill, per vector width in bytes (16: SSE's 16, not NEON's 32).
VECTOR_REGISTERS = {64: 32, 32: 16, 16: 16}


# A node of a tile epilogue: ("total",) the tile's sum; ("const", value); ("operand", n) operand
# n's value at the element; (op, *arguments) for op in TILE_EPILOGUE_OPS.
EpilogueNode = tuple
TILE_EPILOGUE_OPS = {"add": 2, "sub": 2, "mul": 2, "div": 2, "neg": 1, "min": 2, "max": 2,
                     "select": 3, "lt": 2, "le": 2, "gt": 2, "ge": 2, "eq": 2, "ne": 2,
                     "and": 2, "or": 2, "not": 1}
# The C operator of each comparison (the C-style renderers spell them from this table too).
COMPARISONS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_MASK_OPS = {"and": "&", "or": "|"}


@dataclass(frozen=True)
class TileEpilogue:
    """Call-free math applied to every accumulator in registers before the tile's last store:
    `value`, a tree of `EpilogueNode`s over the sum and `operands`, each a pointer the kernel
    takes (`e0`, `e1`, …) at the tile's first element with its (row stride, column stride):
    (s, 0) one value per row (a bias per output channel), broadcast along it; (0, 1) one per
    column, loaded as vectors; (s, 1) one per element (a residual), rows s apart, loaded as
    vectors; (0, 0) one value for the tile."""

    value: EpilogueNode
    operands: tuple[tuple[int, int], ...]

    @property
    def tag(self) -> str:
        return hashlib.sha1(repr(self).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class MicroKernel:
    dtype: str  # "float32" or "float64"
    mr: int
    nr: int
    vector_bytes: int
    indirect: bool = False  # B rows at b + rows[k] (an int32 offset table), not b + k·ldb
    local: bool = False  # A and B in a GPU work-group's local memory (`kiln.codegen.gemm.group`)
    # 0: A in packed panels; > 0: A row-major, rows `lda` elements apart (a compile-time constant,
    # so every row's broadcast addresses off one pointer)
    lda: int = 0
    # 0: as `lda` says; > 0: A column-major, step k of the sum `a_step` elements on (a[k·a_step + r])
    a_step: int = 0
    epilogue: TileEpilogue | None = None  # applied in registers when the call says `finish`
    # A rows at a + bases[r] + rows[k] (int32 tables), the finished tile stored transposed
    # (`pixel_rows_source`)
    pixel_rows: bool = False
    # > 0: at each step of the sum, ask for the line at `ahead + k · b_spread` (an argument after
    # `accumulate`), the call's share of the next slice of B's panels that the block's other
    # tiles read too; 0: B's rows `PREFETCH_STEPS` steps ahead
    b_spread: int = 0

    @property
    def scalar(self) -> str:
        return {"float32": "float", "float64": "double"}[self.dtype]

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def lanes(self) -> int:
        return self.vector_bytes // self.itemsize

    @property
    def function(self) -> str:
        kind = (("ind_" if self.indirect else "") + ("loc_" if self.local else "")
                + ("pix_" if self.pixel_rows else "")
                + (f"a{self.lda}_" if self.lda else "")
                + (f"s{self.a_step}_" if self.a_step else "")
                + (f"e{self.epilogue.tag}_" if self.epilogue else "")
                + (f"p{self.b_spread}_" if self.b_spread else ""))
        return f"kiln_ukr_{kind}{self.dtype}_{self.mr}x{self.nr}_v{self.vector_bytes}"


def tile_for(isa: tuple[str, ...], dtype: str, vector_bytes: int = 0, mr: int = 0,
             nr: int = 0) -> MicroKernel:
    """The micro-kernel for a target's ISA features; nonzero arguments override the choice."""
    chosen = next(((vb, m, n) for feature, vb, m, n in ISA_TILES if feature in isa), FALLBACK_TILE)
    if vector_bytes and vector_bytes != chosen[0]:
        chosen = next(((vb, m, n) for _, vb, m, n in ISA_TILES if vb == vector_bytes),
                      (vector_bytes, 4, 2 * vector_bytes // 4))
    vb, m, n = chosen
    kernel = MicroKernel(dtype, mr or m, nr or n, vb)
    lanes = kernel.lanes
    if kernel.nr % lanes:  # float64 halves the lanes: keep nr a whole number of vectors
        kernel = MicroKernel(dtype, kernel.mr, -(-kernel.nr // lanes) * lanes, vb)
    return kernel


def fits_registers(vector_bytes: int, accumulators: int, b_vectors: int) -> bool:
    """Whether a tile's accumulators, its B vectors and one broadcast of A fit the vector register
    file of `vector_bytes`-wide vectors (no spills in the micro-kernel's loop)."""
    return accumulators + b_vectors + 1 <= VECTOR_REGISTERS.get(vector_bytes, 16)


def same_work_tiles(base: MicroKernel) -> list[tuple[int, int]]:
    """(mr, nr) of the tiles with as many accumulators as `base` (as many FMAs per step of the
    sum), no more loads per step (`mr` broadcasts and `nr / lanes` vectors: the FMAs stay the
    bound) and room in the register file; `base`'s own shape first."""
    lanes = base.lanes
    accumulators, loads = base.mr * base.nr // lanes, base.mr + base.nr // lanes
    shapes = [(accumulators // v, v * lanes) for v in range(1, 5)
              if accumulators % v == 0 and accumulators // v + v <= loads
              and fits_registers(base.vector_bytes, accumulators, v)]
    return [(base.mr, base.nr)] + [t for t in shapes if t != (base.mr, base.nr)]


def padding_tiles(base: MicroKernel) -> list[tuple[int, int]]:
    """`same_work_tiles`, then each of them with a row fewer where that keeps at least
    `PADDING_TILE_CHAINS` of its accumulators: still enough independent FMA chains to hide an
    FMA's latency, for row counts that such a tile divides (AVX-512's 7 × 48 takes a 7 × 7
    image's 49 pixels and a 14 × 14 one's 196 in whole panels, where 6 × 64 pads to 54 rows and
    12 × 32 to 204)."""
    shapes = same_work_tiles(base)
    # a row fewer keeps (mr - 1) / mr of the accumulators, whatever the tile's width
    fewer = [(mr - 1, nr) for mr, nr in shapes if mr > 1 and mr - 1 >= PADDING_TILE_CHAINS * mr]
    return shapes + [t for t in fewer if t not in shapes]


def rows_evict_each_other(k: MicroKernel, row_bytes: int) -> bool:
    """Whether the kernel's rows of A, read in place `row_bytes` apart, put more lines into one L1
    set than it has ways (a row stride of 12 KiB puts all 12 rows of an AVX-512 tile into one), so
    that the rows' lines evict each other between the broadcasts of consecutive steps."""
    lines = {r * row_bytes // 64 for r in range(k.mr)}  # rows in one line share it
    sets = Counter(line % (L1_SET_SPAN // 64) for line in lines)
    return max(sets.values()) > L1_WAYS


def fewer_rows(k: MicroKernel) -> MicroKernel:
    """The same accumulators as half the rows by twice the columns (AVX-512's 12×32 as 6×64: two
    more B vectors, still within 32 registers)."""
    return replace(k, mr=k.mr // 2, nr=k.nr * 2)


def vector_extension_source(k: MicroKernel) -> str:
    """The micro-kernel as C with GCC vector extensions (the C backend's provider)."""
    if k.nr % k.lanes:
        raise ValueError(f"nr={k.nr} is not a multiple of {k.lanes} lanes")
    if k.pixel_rows:
        return pixel_rows_source(k)
    vec, vecu = f"{k.function}_v", f"{k.function}_vu"
    rows = "const int32_t *restrict rows" if k.indirect else "int64_t ldb"
    operands = "".join(f"const {k.scalar} *restrict e{n}, "
                       for n in range(len(k.epilogue.operands) if k.epilogue else 0))
    finish = ", int finish" if k.epilogue else ""
    head = [
        f"typedef {k.scalar} {vec} __attribute__((vector_size({k.vector_bytes})));",
        f"typedef {k.scalar} {vecu} __attribute__((vector_size({k.vector_bytes}), aligned({k.itemsize})));",
        # out of line: inlined into a loop nest whose other loops keep vectors live, GCC spilled
        # an accumulator (a store-to-load round trip per k) and the kernel ran at half speed
        f"static __attribute__((noinline)) void {k.function}(int64_t kc, const {k.scalar} *restrict a, "
        f"const {k.scalar} *restrict b, {rows}, {k.scalar} *restrict c, int64_t ldc, "
        f"int accumulate{f', const {k.scalar} *ahead' if k.b_spread else ''}"
        f"{', ' if operands else ''}{operands.rstrip(', ')}{finish}) {{",
    ]
    load = lambda p: f"*(const {vecu} *)({p})"  # noqa: E731
    body = register_tile_body(k, vec, "int64_t", load=load,
                              store=lambda value, p: f"*({vecu} *)({p}) = {value}",
                              zero=f"({vec}){{0}}", pin=_pinned_in_registers(k),
                              finish=_epilogue_lines(k, vec, load) if k.epilogue else None,
                              prefetch=lambda p: f"__builtin_prefetch({p})")
    return "\n".join(head + body + ["}"])


def pixel_rows_source(k: MicroKernel) -> str:
    """A pixel-rows kernel (module docstring) as C with GCC vector extensions: `kernel(kc, a, b,
    rows, c, ldc, accumulate, [ahead,] bases, out, e0…, finish)`. Each row's broadcasts read off
    a pointer of its own (`a + bases[r]`), the step's offset `rows[k]` loaded once for all rows;
    B's panel rows are `nr` apart. Partial sums stay row-major in the local tile `c` (`nr` apart,
    loaded when `accumulate`); on `finish` the tile epilogue runs and the tile goes to `out`
    transposed, column j (an output channel's `mr` pixels) at `out + j·ldc`, through a local
    array. With `b_spread`, each step asks for `b_spread` elements of B's next slice from
    `ahead` on, the caller's share of it (`conv_pixels`), instead of B's row `PREFETCH_STEPS`
    steps on."""
    vec, vecu = f"{k.function}_v", f"{k.function}_vu"
    lanes, vectors = k.lanes, k.nr // k.lanes
    operands = "".join(f", const {k.scalar} *restrict e{n}"
                       for n in range(len(k.epilogue.operands) if k.epilogue else 0))
    load = lambda p: f"*(const {vecu} *)({p})"  # noqa: E731
    lines = [
        f"typedef {k.scalar} {vec} __attribute__((vector_size({k.vector_bytes})));",
        f"typedef {k.scalar} {vecu} __attribute__((vector_size({k.vector_bytes}), aligned({k.itemsize})));",
        f"static __attribute__((noinline)) void {k.function}(int64_t kc, const {k.scalar} *restrict a, "
        f"const {k.scalar} *restrict b, const int32_t *restrict rows, {k.scalar} *restrict c, "
        f"int64_t ldc, int accumulate{f', const {k.scalar} *ahead' if k.b_spread else ''}, "
        f"const int32_t *restrict bases, {k.scalar} *restrict out{operands}, int finish) {{",
    ]
    lines += [f"  const {k.scalar} *restrict a{r} = a + bases[{r}];" for r in range(k.mr)]
    # opaque to GCC: it otherwise folds them back into `a` and adds each row's base to the
    # step's offset anew (an lea per row per step, 30 instructions per 12 FMAs on AVX2)
    pointers = ", ".join(f'"+r"(a{r})' for r in range(k.mr))
    lines += ["#if defined(__GNUC__)", f'  __asm__("" : {pointers});', "#endif"]
    lines += [f"  {vec} c{r}_{v} = accumulate ? {load(f'c + {r * k.nr + v * lanes}')} : "
              f"({vec}){{0}};" for r in range(k.mr) for v in range(vectors)]
    pin = _pinned_in_registers(k)
    lines += ["  for (int64_t k = 0; k < kc; ++k) {", "    const int64_t o = rows[k];"]
    lines += [f"    {'' if pin else 'const '}{vec} b{v} = {load(f'b + k * {k.nr} + {v * lanes}')};"
              for v in range(vectors)]
    if k.b_spread:
        lines += _spread_lines(k, lambda p: f"__builtin_prefetch({p})")
    else:
        lines += _prefetch_lines(k, lambda p: f"__builtin_prefetch({p})",
                                 f"b + (k + {PREFETCH_STEPS}) * {k.nr}")  # panels in a row
    if pin:
        lines += pin([f"b{v}" for v in range(vectors)])
    for r in range(k.mr):
        lines.append(f"    {{ const {k.scalar} x = a{r}[o];")
        lines.extend(f"      c{r}_{v} += x * b{v};" for v in range(vectors))
        lines.append("    }")
    lines += ["  }", "  if (!finish) {"]
    lines += [f"    *({vecu} *)(c + {r * k.nr + v * lanes}) = c{r}_{v};"
              for r in range(k.mr) for v in range(vectors)]
    lines += ["    return;", "  }"]
    if k.epilogue is not None and k.epilogue.value != ("total",):
        lines += _epilogue_lines(k, vec, load)
    lines.append(f"  {k.scalar} t[{k.mr}][{k.nr}] __attribute__((aligned({k.vector_bytes})));")
    lines += [f"  *({vec} *)&t[{r}][{v * lanes}] = c{r}_{v};"
              for r in range(k.mr) for v in range(vectors)]
    lines.append(f"  for (int64_t j = 0; j < {k.nr}; ++j) {{")
    lines += [f"    out[j * ldc + {r}] = t[{r}][j];" for r in range(k.mr)]
    lines += ["  }", "}"]
    return "\n".join(lines)


def transpose_source(dtype: str, vector_bytes: int) -> tuple[str, str]:
    """The C helper `name(src, lds, dst, ldd, rows, cols)`, dst[c·ldd + r] = src[r·lds + c] for
    r < rows, c < cols, and its name. Whole lanes × lanes blocks go through vector registers: each
    row of a block is loaded as one vector, then log2(lanes) rounds of two-vector shuffles each
    swap one bit of the row index with the same bit of the column index, and each vector is
    stored as a row of the destination; the edges go one element at a time. (A tile read down
    its columns one element at a time cost a fifth of a 7 × 7 conv's time.)"""
    scalar, itemsize = ("float", 4) if dtype == "float32" else ("double", 8)
    lanes = vector_bytes // itemsize
    name = f"kiln_transpose_{dtype}_v{vector_bytes}"
    vec, vecu, mask = f"{name}_v", f"{name}_vu", f"{name}_m"
    shuffle = f"{name.upper()}_SHUFFLE"
    lines = [
        f"typedef {scalar} {vec} __attribute__((vector_size({vector_bytes})));",
        f"typedef {scalar} {vecu} __attribute__((vector_size({vector_bytes}), aligned({itemsize})));",
        f"typedef int{itemsize * 8}_t {mask} __attribute__((vector_size({vector_bytes})));",
        "#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)",
        f"#define {shuffle}(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)",
        "#else",
        f"#define {shuffle}(a, b, ...) __builtin_shuffle(a, b, ({mask}){{__VA_ARGS__}})",
        "#endif",
        f"static void {name}(const {scalar} *restrict src, int64_t lds, {scalar} *restrict dst, "
        "int64_t ldd, int64_t rows, int64_t cols) {",
        "  int64_t r0 = 0;",
        f"  for (; r0 + {lanes} <= rows; r0 += {lanes}) {{",
        "    int64_t c0 = 0;",
        f"    for (; c0 + {lanes} <= cols; c0 += {lanes}) {{",
    ]
    lines += [f"      {vec} x{r} = *(const {vecu} *)(src + (r0 + {r}) * lds + c0);"
              for r in range(lanes)]
    d = lanes // 2
    while d:
        low = ", ".join(str(c if c & d == 0 else lanes + c - d) for c in range(lanes))
        high = ", ".join(str(c + d if c & d == 0 else lanes + c) for c in range(lanes))
        for r in (r for r in range(lanes) if r & d == 0):
            lines.append(f"      {{ const {vec} lo = {shuffle}(x{r}, x{r + d}, {low}), "
                         f"hi = {shuffle}(x{r}, x{r + d}, {high}); x{r} = lo; x{r + d} = hi; }}")
        d //= 2
    lines += [f"      *({vecu} *)(dst + (c0 + {r}) * ldd + r0) = x{r};" for r in range(lanes)]
    lines += [
        "    }",
        "    for (; c0 < cols; ++c0)",
        f"      for (int64_t r = r0; r < r0 + {lanes}; ++r) dst[c0 * ldd + r] = src[r * lds + c0];",
        "  }",
        "  for (int64_t c = 0; c < cols; ++c)",
        "    for (int64_t r = r0; r < rows; ++r) dst[c * ldd + r] = src[r * lds + c];",
        "}",
    ]
    return name, "\n".join(lines)


# Where a vector of so many bytes is one register, the inline-asm constraint that names one.
_VECTOR_REGISTER_CONSTRAINTS = {
    16: (("defined(__x86_64__)", "x"), ("defined(__aarch64__)", "w")),
    32: (("defined(__x86_64__) && defined(__AVX__)", "x"),),
    64: (("defined(__x86_64__) && defined(__AVX512F__)", "v"),),
}


def _pinned_in_registers(k: MicroKernel) -> Callable[[list[str]], list[str]] | None:
    """For a tile that needs the whole register file, lines of an empty asm that takes `values`
    in vector registers and gives them back, so that GCC no longer folds their loads into each
    FMA's memory operand (where a vector is one register; elsewhere nothing). With all 16 AVX2
    registers needed (a 4 × 24 tile: 12 accumulators, 3 B vectors, a broadcast) GCC 12 did so,
    reloading B for every FMA, 16 loads per 12 FMAs: the tile ran 1.3× as long as a 6 × 16 one,
    0.9× with B pinned."""
    vectors = k.nr // k.lanes
    if fits_registers(k.vector_bytes, k.mr * vectors + 1, vectors):
        return None  # a register to spare: GCC keeps B in registers itself
    if not fits_registers(k.vector_bytes, k.mr * vectors, vectors):
        return None  # B cannot stay in registers anyway (a 1 × 64 NEON row: 16 B vectors)

    def pin(values: list[str]) -> list[str]:
        lines = []
        for condition, constraint in _VECTOR_REGISTER_CONSTRAINTS.get(k.vector_bytes, ()):
            operands = ", ".join(f'"+{constraint}"({v})' for v in values)
            lines += [f"#{'el' if lines else ''}if defined(__GNUC__) && {condition}",
                      f'    __asm__("" : {operands});']
        return lines + ["#endif"] if lines else []
    return pin


def register_tile_body(k: MicroKernel, vec: str, index: str, load: Callable[[str], str],
                       store: Callable[[str, str], str], zero: str,
                       pin: Callable[[list[str]], list[str]] | None = None,
                       finish: list[str] | None = None,
                       prefetch: Callable[[str], str] | None = None) -> list[str]:
    """The body of a micro-kernel function over (kc, a, b, ldb, c, ldc, accumulate): `mr` ×
    `nr / lanes` accumulators of the vector type `vec`, loaded (`load(pointer)`) or `zero`, updated
    `kc` times, stored (`store(value, pointer)`). Every backend's micro-kernel shares it; each
    spells its vector type and memory accesses, and `pin` (lines that keep the step's B vectors in
    registers), if it has one; `finish`: lines run before the store when the call's `finish` is
    set (the kernel's `TileEpilogue` over the accumulators); `prefetch(pointer)`, if given, a
    statement that asks for the cache line at `pointer` ahead of its use (`PREFETCH_STEPS`)."""
    lanes, vectors = k.lanes, k.nr // k.lanes
    acc = [[f"c{r}_{v}" for v in range(vectors)] for r in range(k.mr)]
    lines = [f"  {vec} {acc[r][v]} = accumulate ? {load(f'c + {r} * ldc + {v * lanes}')} : {zero};"
             for r in range(k.mr) for v in range(vectors)]
    ahead = prefetch is not None and _prefetches_b(k) and not k.b_spread
    if ahead:
        lines += _b_ahead_start(k, index)
    lines.append(f"  for ({index} k = 0; k < kc; ++k) {{")
    row = "rows[k]" if k.indirect else "k * ldb"  # an indirect kernel reads B rows by offset
    const = "" if pin else "const "
    lines += [f"    {const}{vec} b{v} = {load(f'b + {row} + {v * lanes}')};"
              for v in range(vectors)]
    if prefetch:
        lines += _prefetch_lines(k, prefetch, "ahead" if ahead else None)
    if prefetch and k.b_spread:
        lines += _spread_lines(k, prefetch)
    if pin:
        lines += pin([f"b{v}" for v in range(vectors)])
    for r in range(k.mr):
        element = (f"a[{r * k.lda} + k]" if k.lda
                   else f"a[k * {k.a_step or k.mr} + {r}]")
        lines.append(f"    {{ const {k.scalar} a{r} = {element};")
        lines.extend(f"      {acc[r][v]} += a{r} * b{v};" for v in range(vectors))
        lines.append("    }")
    if ahead:
        lines += _B_AHEAD_STEP
    lines.append("  }")
    if finish:
        lines += ["  if (finish) {", *finish, "  }"]
    lines += ["  " + store(acc[r][v], f"c + {r} * ldc + {v * lanes}") + ";"
              for r in range(k.mr) for v in range(vectors)]
    return lines


def _prefetches_b(k: MicroKernel) -> bool:
    """Whether a GEMM kernel asks for B's lines ahead: not one of one row, whose loop is bound by
    its loads (`_prefetch_lines`), nor an indirect one, whose rows jump."""
    return k.mr > 1 and not k.indirect


def _b_ahead_start(k: MicroKernel, index: str) -> list[str]:
    """Lines before the sum's loop that point `ahead` at B's row `PREFETCH_STEPS` steps on, in the
    call's B or, past its last step, in the next call's: in a packed panel (`ldb` = `nr`) the next
    call's panel follows this one; in rows read in place its tile starts `nr` columns on, at row
    0. `_B_AHEAD_STEP` moves it along, wrapping from one tile to the next. Asking only for rows
    `PREFETCH_STEPS` on within the operand's columns, a sum shorter than that asked for nothing
    it reads (MobileNetV2's 16 → 96 channel 1 × 1 conv at 112², its inputs in L2: 1.2× the time;
    its 32 → 16 one, its inputs out of the caches: 1.8×)."""
    return [f"  const {index} ahead_wrap = ldb == {k.nr} ? kc * ldb : {k.nr};",
            f"  const {index} ahead_tiles = kc > 0 ? {PREFETCH_STEPS} / kc : 0;",
            f"  {index} ahead_row = kc > 0 ? {PREFETCH_STEPS} % kc : 0;",
            f"  const {k.scalar} *ahead = b + ahead_tiles * ahead_wrap + ahead_row * ldb;"]


_B_AHEAD_STEP = ["    ahead += ldb;",
                 "    if (++ahead_row == kc) { ahead_row = 0; ahead += ahead_wrap - kc * ldb; }"]


def _spread_lines(k: MicroKernel, prefetch: Callable[[str], str]) -> list[str]:
    """A step's requests for its `b_spread` elements of the share of B's next slice that the
    call's `ahead` points at (`MicroKernel.b_spread`)."""
    return [f"    {prefetch(f'ahead + k * {k.b_spread} + {e}')};"
            for e in range(0, k.b_spread, 64 // k.itemsize)]


def _prefetch_lines(k: MicroKernel, prefetch: Callable[[str], str],
                    b_ahead: str | None) -> list[str]:
    """Requests, `PREFETCH_STEPS` steps ahead, for the streams a step reads in order: B's row at
    the pointer `b_ahead` (none without one) and a packed A panel's `mr` values (a convolution's
    weights); none in a 1-row GEMM kernel."""
    if k.mr == 1 and not k.pixel_rows:
        # a vector times weights: one FMA per vector of B, so the loop is bound by its loads, and
        # a request per line of B takes a load slot each, for one long sequential stream that the
        # hardware prefetcher follows anyway (an LSTM's recurrent sums on Zen 4: 0.85x the time
        # without them; a pixel-rows kernel's last row, over a panel of weights that other tiles
        # read too, ran 1.01-1.04x the time without them)
        return []
    line_elements = 64 // k.itemsize
    lines = []
    if b_ahead:
        lines += [f"    {prefetch(f'{b_ahead} + {e}')};" for e in range(0, k.nr, line_elements)]
    if not k.lda and not k.a_step and not k.pixel_rows:
        lines.append(f"    {prefetch(f'a + (k + {PREFETCH_STEPS}) * {k.mr}')};")
    return lines


def _epilogue_lines(k: MicroKernel, vec: str, load: Callable[[str], str]) -> list[str]:
    """The kernel's `TileEpilogue` over each accumulator, in GCC vector extensions: comparisons
    give lane masks (all ones or zeros), a select blends by them bitwise (C has no vector `?:`;
    GCC makes it one blend instruction), min and max pass a NaN on as the scalar code does."""
    assert k.epilogue is not None
    lines: list[str] = []
    for r in range(k.mr):
        for v in range(k.nr // k.lanes):
            names: dict[EpilogueNode, str] = {}
            lines.append("    {")
            acc = f"c{r}_{v}"
            value = _epilogue_node(k, vec, load, k.epilogue.value, (r, v, acc), names, lines)
            lines += [f"      {acc} = {value};", "    }"]
    return lines


def _epilogue_node(k: MicroKernel, vec: str, load: Callable[[str], str], node: EpilogueNode,
                   at: tuple[int, int, str], names: dict[EpilogueNode, str],
                   lines: list[str]) -> str:
    """The name of a temporary holding `node` for accumulator `at` = (row, vector, name)."""
    if node in names:
        return names[node]
    r, v, acc = at
    kind = node[0]
    if kind == "total":
        return acc
    if kind == "const":
        suffix = "f" if k.dtype == "float32" else ""
        text = f"(({vec}){{0}} + {float(node[1]).hex()}{suffix})"
    elif kind == "operand":
        row_stride, col_stride = k.epilogue.operands[node[1]]
        pointer = f"e{node[1]}"
        text = (load(f"{pointer} + {r * row_stride + v * k.lanes}") if col_stride
                else f"(({vec}){{0}} + {pointer}[{r * row_stride}])")
    else:
        args = [_epilogue_node(k, vec, load, a, at, names, lines) for a in node[1:]]
        text = _epilogue_op(kind, vec, args)
    name = f"t{len(names)}"
    names[node] = name
    lines.append(f"      const __auto_type {name} = {text};")
    return name


def _epilogue_op(kind: str, vec: str, a: list[str]) -> str:
    if kind in ("add", "sub", "mul", "div"):
        return f"({a[0]} {dict(add='+', sub='-', mul='*', div='/')[kind]} {a[1]})"
    if kind == "neg":
        return f"(-{a[0]})"
    if kind in COMPARISONS:
        return f"({a[0]} {COMPARISONS[kind]} {a[1]})"
    if kind in _MASK_OPS:
        return f"({a[0]} {_MASK_OPS[kind]} {a[1]})"
    if kind == "not":
        return f"(~{a[0]})"
    if kind in ("min", "max"):  # the scalar code's (a < b || a != a) ? a : b
        mask = f"(({a[0]} {'<' if kind == 'min' else '>'} {a[1]}) | ({a[0]} != {a[0]}))"
        return _blend(vec, mask, a[0], a[1])
    if kind == "select":
        return _blend(vec, a[0], a[1], a[2])
    raise ValueError(f"no vector form of {kind}")


def _blend(vec: str, mask: str, yes: str, no: str) -> str:
    bits = f"__typeof__({mask})"
    return f"(({vec})(({mask} & ({bits}){yes}) | (~{mask} & ({bits}){no})))"


def epilogue_constant(value: float) -> bool:
    """Whether a constant can appear in a tile epilogue (as an exact hexadecimal literal)."""
    return math.isfinite(value)
