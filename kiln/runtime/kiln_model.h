/* The interface of a model compiled by Kiln (the library in an artifact, and its runner).
 *
 * A model is created once from its weights file; creating it allocates the arena (all
 * intermediate results) and the scratch memory, and reads the weights. Each run then makes
 * no allocation: it calls the model's kernels in plan order on the caller's input and output
 * buffers (dense, row-major, of the dtypes and shapes the descriptors below give).
 *
 * A model is not re-entrant: one run at a time per kiln_model.
 */
#ifndef KILN_MODEL_H
#define KILN_MODEL_H

#include <stddef.h>
#include <stdint.h>

typedef struct kiln_model kiln_model;

typedef struct {
    const char *dtype;     /* numpy array-protocol type string, e.g. "<f4", "<i8", "|b1" */
    int rank;
    const int64_t *shape;
    size_t nbytes;
} kiln_tensor_desc;

typedef struct {
    const char *symbol;    /* the kernel's symbol in Kiln's plan, e.g. "k3_fused_matmul_add" */
    const char *block;     /* the plan block it computes, e.g. "b3" */
} kiln_kernel_desc;

extern const int kiln_model_num_inputs;
extern const int kiln_model_num_outputs;
extern const int kiln_model_num_kernels;
extern const kiln_tensor_desc kiln_model_inputs[];
extern const kiln_tensor_desc kiln_model_outputs[];
extern const kiln_kernel_desc kiln_model_kernels[];
extern const size_t kiln_model_weights_bytes;

/* NULL on failure, with a message in `error` (when error_size > 0). The thread count starts
 * at $KILN_NUM_THREADS when set, else 0 (the thread pool's default: $OMP_NUM_THREADS, else
 * the CPUs this process may run on). */
kiln_model *kiln_model_create(const char *weights_path, char *error, size_t error_size);

/* Threads each run uses (0: the thread pool's default). */
void kiln_model_set_threads(kiln_model *model, int threads);
int kiln_model_threads(const kiln_model *model);

/* When `kernel_ns` is not NULL, each run adds the nanoseconds every kernel took to
 * kernel_ns[0 .. kiln_model_num_kernels-1]; NULL turns profiling off. */
void kiln_model_set_profile(kiln_model *model, uint64_t *kernel_ns);

/* 0 on success. */
int kiln_model_run(kiln_model *model, void *const *inputs, void *const *outputs);

void kiln_model_destroy(kiln_model *model);

#endif
