/* The CUDA device side on the CPU, for tests without a GPU: prepended to a model's CUDA kernels
 * when the test compiles them as C++ for this machine (fake_libcuda.cpp runs them). The thread
 * indices are this module's globals, set by the fake driver before it runs each thread; a
 * block's threads run as fibers that switch at every __syncwarp and __syncthreads and twice per
 * __shfl_xor_sync, so lanes exchange values the way a warp's do and a block's threads meet at
 * barriers. A __shared__ array is a static one: one per kernel, which the block's threads share
 * (blocks run one after another). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define __global__
#define __device__
#define __shared__ static

struct kiln_emu_dim { unsigned x, y, z; };
extern "C" {
kiln_emu_dim blockIdx, blockDim, threadIdx;
void (*kiln_emu_yield)(void);
unsigned long long kiln_emu_slots[1024];  /* a slot per thread of the block */
}

template <typename T> static inline T __shfl_xor_sync(unsigned mask, T value, int offset) {
  (void)mask;
  const unsigned thread = threadIdx.x;
  T other;
  memcpy(&kiln_emu_slots[thread], &value, sizeof value);
  kiln_emu_yield();  /* every lane has written */
  memcpy(&other, &kiln_emu_slots[thread ^ (unsigned)offset], sizeof other);
  kiln_emu_yield();  /* every lane has read */
  return other;
}

static inline void __syncwarp(void) { kiln_emu_yield(); }
static inline void __syncthreads(void) { kiln_emu_yield(); }

static inline float __int_as_float(int bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
