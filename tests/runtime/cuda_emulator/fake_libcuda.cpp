/* A stand-in libcuda.so.1 for tests without a GPU: the CUDA driver API calls Kiln's CUDA driver
 * makes, run on the CPU. Device memory is host memory; cuModuleLoadData ignores the image it is
 * given (it notes whether it was the cubin or the PTX in $KILN_FAKE_CUDA_LOG) and loads the
 * kernels compiled for this machine from $KILN_FAKE_CUDA_MODULE (see emulator.h; each entry point
 * NAME has a wrapper kiln_emu_NAME(void **params)); cuLaunchKernel runs every thread of the grid,
 * a block's threads as fibers (so barriers and warp shuffles meet). The GPU's compute capability is
 * $KILN_FAKE_CUDA_CAPABILITY (8.0). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <string>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
struct kiln_emu_dim { unsigned x, y, z; };
typedef void (*wrapper_fn)(void **);

namespace {
struct Module {
  void *handle;
  kiln_emu_dim *block_idx, *block_dim, *thread_idx;
};
struct Function {
  Module *module;
  wrapper_fn run;
};

const int kThreads = 1024;  // the most a block has
const size_t kStack = 256 * 1024;
ucontext_t scheduler, lanes[kThreads];
char *stacks[kThreads];
int finished[kThreads];
int current;
Function *running;
void **running_params;
CUresult kFailed = 1;

void yield() { swapcontext(&lanes[current], &scheduler); }

void lane_main() {
  running->run(running_params);
  finished[current] = 1;
}

void run_block(Function *f, void **params, unsigned block, int count) {
  running = f;
  running_params = params;
  for (int lane = 0; lane < count; lane++) {
    if (!stacks[lane]) stacks[lane] = static_cast<char *>(malloc(kStack));
    getcontext(&lanes[lane]);
    lanes[lane].uc_stack.ss_sp = stacks[lane];
    lanes[lane].uc_stack.ss_size = kStack;
    lanes[lane].uc_link = &scheduler;
    makecontext(&lanes[lane], lane_main, 0);
    finished[lane] = 0;
  }
  for (int left = count; left > 0;) {
    left = 0;
    for (int lane = 0; lane < count; lane++) {
      if (finished[lane]) continue;
      current = lane;
      f->module->block_idx->x = block;
      f->module->thread_idx->x = (unsigned)lane;
      swapcontext(&scheduler, &lanes[lane]);
      if (!finished[lane]) left++;
    }
  }
}

int capability(int part) {
  const char *text = getenv("KILN_FAKE_CUDA_CAPABILITY");
  int major = 8, minor = 0;
  if (text) sscanf(text, "%d.%d", &major, &minor);
  return part == 0 ? major : minor;
}
}  // namespace

extern "C" {
CUresult cuGetErrorString(CUresult, const char **text) {
  *text = "emulated CUDA error";
  return 0;
}
CUresult cuInit(unsigned) { return 0; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return 0; }
CUresult cuDeviceGet(int *device, int index) { *device = index; return 0; }
CUresult cuDeviceGetAttribute(int *value, int attribute, int) {
  *value = attribute == 75 ? capability(0) : attribute == 76 ? capability(1) : 4;
  return 0;
}
CUresult cuDeviceGetName(char *name, int size, int) {
  snprintf(name, (size_t)size, "Kiln CUDA emulator");
  return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **context, int) { *context = &scheduler; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
CUresult cuCtxSetCurrent(void *) { return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuModuleLoadData(Module **module, const void *image) {
  const char *log = getenv("KILN_FAKE_CUDA_LOG");
  const char *path = getenv("KILN_FAKE_CUDA_MODULE");
  Module *m;
  if (log) {
    FILE *f = fopen(log, "a");
    if (f) {
      fputs(memcmp(image, "\x7f" "ELF", 4) == 0 ? "cubin\n" : "ptx\n", f);
      fclose(f);
    }
  }
  void *handle = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
  if (!handle) return kFailed;
  m = new Module{handle, static_cast<kiln_emu_dim *>(dlsym(handle, "blockIdx")),
                 static_cast<kiln_emu_dim *>(dlsym(handle, "blockDim")),
                 static_cast<kiln_emu_dim *>(dlsym(handle, "threadIdx"))};
  *reinterpret_cast<void (**)(void)>(dlsym(handle, "kiln_emu_yield")) = yield;
  *module = m;
  return 0;
}
CUresult cuModuleGetFunction(Function **function, Module *module, const char *name) {
  std::string wrapper = std::string("kiln_emu_") + name;
  void *run = dlsym(module->handle, wrapper.c_str());
  if (!run) return kFailed;
  *function = new Function{module, reinterpret_cast<wrapper_fn>(run)};
  return 0;
}
CUresult cuModuleUnload(Module *module) {
  dlclose(module->handle);
  delete module;
  return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *where, size_t nbytes) {
  void *p = calloc(1, nbytes);
  *where = (CUdeviceptr)p;
  return p ? 0 : 2;
}
CUresult cuMemFree_v2(CUdeviceptr where) { free((void *)where); return 0; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr to, const void *from, size_t n) {
  memcpy((void *)to, from, n);
  return 0;
}
CUresult cuMemcpyDtoH_v2(void *to, CUdeviceptr from, size_t n) {
  memcpy(to, (const void *)from, n);
  return 0;
}
CUresult cuLaunchKernel(Function *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned, void *, void **params, void **) {
  if (gy != 1 || gz != 1 || by != 1 || bz != 1 || bx > (unsigned)kThreads) return kFailed;
  f->module->block_dim->x = bx;
  for (unsigned block = 0; block < gx; block++) run_block(f, params, block, (int)bx);
  return 0;
}
}
