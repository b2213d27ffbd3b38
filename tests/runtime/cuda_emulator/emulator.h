/* The CUDA device side on the CPU, for tests without a GPU: prepended to a model's CUDA kernels
 * when the test compiles them as C++ for this machine (fake_libcuda.cpp runs them). The thread
 * indices are this module's globals, set by the fake driver before it runs each thread; a warp's
 * 32 threads run as fibers that switch at every __syncwarp and twice per __shfl_xor_sync, so
 * lanes exchange values the way a warp's do. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define __global__
#define __device__

struct kiln_emu_dim { unsigned x, y, z; };
extern "C" {
kiln_emu_dim blockIdx, blockDim, threadIdx;
void (*kiln_emu_yield)(void);
unsigned long long kiln_emu_slots[32];
}

template <typename T> static inline T __shfl_xor_sync(unsigned mask, T value, int offset) {
  (void)mask;
  const unsigned lane = threadIdx.x % 32u;
  T other;
  memcpy(&kiln_emu_slots[lane], &value, sizeof value);
  kiln_emu_yield();  /* every lane has written */
  memcpy(&other, &kiln_emu_slots[lane ^ (unsigned)offset], sizeof other);
  kiln_emu_yield();  /* every lane has read */
  return other;
}

static inline void __syncwarp(void) { kiln_emu_yield(); }

static inline float __int_as_float(int bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
