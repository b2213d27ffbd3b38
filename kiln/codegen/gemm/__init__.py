"""GEMM code generation, shared by every op that contracts (MatMul, Gemm, Einsum, convolutions,
recurrences, quantized products): `contraction.contraction` picks the loop nest for a
`spec.Contraction`; the packed GotoBLAS GEMM (`packed`) with its blocking (`blocking`), operand
packing (`packing`), or on GPUs the work-group tiled GEMM (`group`); the micro-kernel shapes are
`kiln.codegen.microkernel`'s (the IR and the schedules name them too)."""
