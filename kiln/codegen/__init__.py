"""Code generation: each block of a fusion plan becomes one C function (the kernel ABI below).

Kernel ABI, shared by the code generator and the runtime that calls the kernels:

    void <Kernel.symbol>(void *const *args);

`args[i]` points to the buffer of tensor `Kernel.args[i]` (dense, row-major, the tensor's dtype).
The args are the block's inputs the kernel reads (activations, weights, and derived constants it
asked for), then the block's outputs it writes; when `scratch_bytes` > 0, one more pointer to that
many bytes of 64-byte-aligned scratch memory follows (the runtime owns it and may reuse it between
kernels). Kernels run their parallel loops on Kiln's thread pool; the runtime sets the thread
count. A kernel never allocates, never keeps state between calls and never writes its inputs.
"""
from __future__ import annotations

from kiln.codegen.generate import check_supported as check_supported
from kiln.codegen.generate import generate as generate
from kiln.codegen.generate import supported_ops as supported_ops
from kiln.codegen.kernel import Kernel as Kernel
