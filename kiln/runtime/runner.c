/* kiln-runner: runs a model compiled by Kiln on its own (no Python), for benchmarks and devices.
 *
 * usage: kiln-runner [-n RUNS] [-w WARMUP] [-t THREADS] [-o DIR] WEIGHTS INPUT.npy...
 *
 *   WEIGHTS      the artifact's weights.bin
 *   INPUT.npy    one .npy file per model input, in the manifest's input order; each must hold
 *                a C-ordered array of exactly the input's dtype and shape
 *   -n RUNS      timed runs (default 10)
 *   -w WARMUP    untimed warm-up runs first (default 2)
 *   -t THREADS   threads (default: $KILN_NUM_THREADS, else $OMP_NUM_THREADS, else
 *                the CPUs this process may run on)
 *   -o DIR       write the outputs of the last run to DIR/output_<i>.npy (the folder must exist)
 *
 * Prints one JSON object on stdout:
 *   {"threads": T, "warmup": W, "runs": N, "peak_rss_bytes": R,
 *    "latency_ns": {"median": …, "p10": …, "p90": …, "min": …, "max": …},
 *    "kernels": [{"index": i, "symbol": "k0_add", "block": "b0", "median_ns": …, "p10_ns": …,
 *                 "p90_ns": …, "samples_ns": [run 0, run 1, …]}, …]}
 * Each kernel's "samples_ns" lists its time in every timed run, in run order, when RUNS is at most
 * MAX_PRINTED_SAMPLES; with more runs it is left out (median, p10 and p90 are always there).
 * "peak_rss_bytes" is the process's peak resident set size after the last run (VmHWM of
 * /proc/self/status): the measured counterpart of the manifest's planned peak_memory_bytes, plus
 * the runner's code and the C runtime; it is left out where /proc cannot be read. Not getrusage's
 * ru_maxrss: Linux carries that over exec from the process that forked the runner.
 * Exit status: 0 on success, 2 for bad arguments or input files, 1 when the model fails.
 *
 * The kernels' parallel loops run on Kiln's thread pool (kiln/codegen/render/pool.c): its workers
 * spin for $KILN_SPIN_US microseconds after a loop, then sleep, and a loop never waits for a
 * worker that has not woken: the calling thread takes its share.
 */
#include "kiln_model.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NPY_MAGIC "\x93NUMPY"
#define MAX_RANK 32
#define MAX_PRINTED_SAMPLES 100

static void die(int status, const char *format, ...) {
    va_list ap;
    fputs("kiln-runner: error: ", stderr);
    va_start(ap, format);
    vfprintf(stderr, format, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(status);
}

static long parse_count(const char *text, const char *what, long minimum) {
    char *end;
    long value;
    errno = 0;
    value = strtol(text, &end, 10);
    if (errno || *end || end == text || value < minimum || value > 1000000000L)
        die(2, "%s must be an integer >= %ld, got '%s'", what, minimum, text);
    return value;
}

/* The peak resident set size of this process in bytes, or 0 when /proc/self/status lacks it. */
static unsigned long long peak_rss_bytes(void) {
    char line[256];
    unsigned long long kib = 0;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %llu kB", &kib) == 1) break;
    fclose(f);
    return kib * 1024u;
}

static void *alloc_buffer(size_t nbytes) {
    void *p = aligned_alloc(64, (nbytes + 63u) / 64u * 64u + 64u);
    if (!p) die(1, "out of memory allocating %zu bytes", nbytes);
    return p;
}

/* ---- .npy files --------------------------------------------------------------------------- */

static void format_shape(char *out, size_t size, int rank, const int64_t *shape) {
    size_t used = (size_t)snprintf(out, size, "(");
    int i;
    for (i = 0; i < rank && used < size; i++)
        used += (size_t)snprintf(out + used, size - used, "%s%lld", i ? ", " : "",
                                 (long long)shape[i]);
    if (used < size) snprintf(out + used, size - used, rank == 1 ? ",)" : ")");
}

/* The value after `'key':` in a .npy header dictionary, or NULL. */
static const char *header_value(const char *header, const char *key) {
    char quoted[32];
    const char *at;
    snprintf(quoted, sizeof quoted, "'%s':", key);
    at = strstr(header, quoted);
    if (!at) return NULL;
    at += strlen(quoted);
    while (*at == ' ') at++;
    return at;
}

static int parse_header(const char *header, char *descr, size_t descr_size, int *fortran,
                        int *rank, int64_t *shape) {
    const char *d = header_value(header, "descr");
    const char *f = header_value(header, "fortran_order");
    const char *s = header_value(header, "shape");
    const char *end;
    size_t n;
    if (!d || !f || !s || (*d != '\'' && *d != '"') || *s != '(') return -1;
    end = strchr(d + 1, *d);
    n = end ? (size_t)(end - d - 1) : 0;
    if (!end || n >= descr_size) return -1;
    memcpy(descr, d + 1, n);
    descr[n] = '\0';
    *fortran = strncmp(f, "True", 4) == 0;
    *rank = 0;
    for (s++; *s != ')';) {
        char *after;
        long long dim;
        while (*s == ' ' || *s == ',') s++;
        if (*s == ')') break;
        errno = 0;
        dim = strtoll(s, &after, 10);
        if (after == s || errno || dim < 0 || *rank >= MAX_RANK) return -1;
        shape[(*rank)++] = dim;
        s = after;
        while (*s == ' ' || *s == 'L') s++;
        if (*s != ',' && *s != ')') return -1;
    }
    return 0;
}

static void read_npy(const char *path, int index, const kiln_tensor_desc *want, void *data) {
    unsigned char preamble[10];
    char header[4096], descr[32], got_shape[512], want_shape[512];
    size_t header_len;
    int64_t shape[MAX_RANK] = {0};
    int fortran, rank, i, same;
    FILE *f = fopen(path, "rb");
    if (!f) die(2, "input %d: cannot open %s: %s", index, path, strerror(errno));
    if (fread(preamble, 1, 8, f) != 8 || memcmp(preamble, NPY_MAGIC, 6) != 0)
        die(2, "input %d: %s is not a .npy file", index, path);
    if (fread(preamble + 8, 1, 2, f) != 2) die(2, "input %d: %s is truncated", index, path);
    header_len = (size_t)preamble[8] | (size_t)preamble[9] << 8;
    if (preamble[6] >= 2) {  /* versions 2 and 3: a 4-byte header length */
        unsigned char more[2];
        if (fread(more, 1, 2, f) != 2) die(2, "input %d: %s is truncated", index, path);
        header_len |= (size_t)more[0] << 16 | (size_t)more[1] << 24;
    }
    if (header_len >= sizeof header || fread(header, 1, header_len, f) != header_len)
        die(2, "input %d: %s has a truncated or oversized header", index, path);
    header[header_len] = '\0';
    if (parse_header(header, descr, sizeof descr, &fortran, &rank, shape) != 0)
        die(2, "input %d: %s has an unreadable .npy header", index, path);
    format_shape(want_shape, sizeof want_shape, want->rank, want->shape);
    format_shape(got_shape, sizeof got_shape, rank, shape);
    same = rank == want->rank;
    for (i = 0; same && i < rank; i++) same = shape[i] == want->shape[i];
    if (strcmp(descr, want->dtype) != 0 || !same)
        die(2, "input %d: %s holds dtype %s shape %s; the model expects dtype %s shape %s",
            index, path, descr, got_shape, want->dtype, want_shape);
    if (fortran && rank > 1)
        die(2, "input %d: %s is Fortran-ordered; save a C-contiguous array", index, path);
    if ((want->nbytes && fread(data, 1, want->nbytes, f) != want->nbytes) || fgetc(f) != EOF)
        die(2, "input %d: %s does not hold exactly %zu bytes of data", index, path, want->nbytes);
    fclose(f);
}

static void write_npy(const char *dir, int index, const kiln_tensor_desc *desc, const void *data) {
    char path[4096], shape[512], header[1024];
    unsigned char preamble[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0, 0};
    size_t len, padded;
    FILE *f;
    snprintf(path, sizeof path, "%s/output_%d.npy", dir, index);
    format_shape(shape, sizeof shape, desc->rank, desc->shape);
    len = (size_t)snprintf(header, sizeof header, "{'descr': '%s', 'fortran_order': False, "
                           "'shape': %s, }", desc->dtype, shape);
    padded = (len + 1 + sizeof preamble + 63u) / 64u * 64u - sizeof preamble;
    memset(header + len, ' ', padded - len);
    header[padded - 1] = '\n';
    preamble[8] = (unsigned char)(padded & 0xff);
    preamble[9] = (unsigned char)(padded >> 8);
    f = fopen(path, "wb");
    if (!f) die(1, "cannot write %s: %s", path, strerror(errno));
    if (fwrite(preamble, 1, sizeof preamble, f) != sizeof preamble ||
        fwrite(header, 1, padded, f) != padded ||
        (desc->nbytes && fwrite(data, 1, desc->nbytes, f) != desc->nbytes) || fclose(f) != 0)
        die(1, "cannot write %s", path);
}

/* ---- timing ------------------------------------------------------------------------------- */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int compare_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The p-quantile of n values (sorted in place), interpolating linearly between ranks. */
static uint64_t quantile(uint64_t *values, size_t n, double p) {
    double at = p * (double)(n - 1);
    size_t lo = (size_t)at;
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    qsort(values, n, sizeof *values, compare_u64);
    return (uint64_t)((double)values[lo] + (at - (double)lo) * ((double)values[hi] - (double)values[lo]) + 0.5);
}

/* ---- main --------------------------------------------------------------------------------- */

static void usage(void) {
    die(2, "usage: kiln-runner [-n RUNS] [-w WARMUP] [-t THREADS] [-o DIR] WEIGHTS INPUT.npy...");
}

int main(int argc, char **argv) {
    long runs = 10, warmup = 2, threads = -1;
    const char *out_dir = NULL;
    char error[512];
    void **inputs, **outputs;
    uint64_t *totals, *kernel_ns, *per_run, *column;
    unsigned long long rss;
    kiln_model *model;
    int opt, i, k;
    long r;

    while ((opt = getopt(argc, argv, "n:w:t:o:")) != -1) {
        switch (opt) {
        case 'n': runs = parse_count(optarg, "-n RUNS", 1); break;
        case 'w': warmup = parse_count(optarg, "-w WARMUP", 0); break;
        case 't': threads = parse_count(optarg, "-t THREADS", 0); break;
        case 'o': out_dir = optarg; break;
        default: usage();
        }
    }
    if (argc - optind != 1 + kiln_model_num_inputs) {
        if (argc - optind < 1) usage();
        die(2, "the model has %d input(s) but %d input file(s) were given", kiln_model_num_inputs,
            argc - optind - 1);
    }
    inputs = calloc((size_t)kiln_model_num_inputs + 1, sizeof *inputs);
    outputs = calloc((size_t)kiln_model_num_outputs + 1, sizeof *outputs);
    if (!inputs || !outputs) die(1, "out of memory");
    for (i = 0; i < kiln_model_num_inputs; i++) {
        inputs[i] = alloc_buffer(kiln_model_inputs[i].nbytes);
        read_npy(argv[optind + 1 + i], i, &kiln_model_inputs[i], inputs[i]);
    }
    for (i = 0; i < kiln_model_num_outputs; i++)
        outputs[i] = alloc_buffer(kiln_model_outputs[i].nbytes);

    model = kiln_model_create(argv[optind], error, sizeof error);
    if (!model) die(2, "%s", error);
    if (threads >= 0) kiln_model_set_threads(model, (int)threads);

    totals = calloc((size_t)runs, sizeof *totals);
    kernel_ns = calloc((size_t)kiln_model_num_kernels + 1, sizeof *kernel_ns);
    per_run = calloc((size_t)runs * ((size_t)kiln_model_num_kernels + 1), sizeof *per_run);
    column = calloc((size_t)runs, sizeof *column);
    if (!totals || !kernel_ns || !per_run || !column) die(1, "out of memory");

    for (r = 0; r < warmup; r++)
        if (kiln_model_run(model, inputs, outputs) != 0) die(1, "the model failed");
    kiln_model_set_profile(model, kernel_ns);
    for (r = 0; r < runs; r++) {
        uint64_t start;
        memset(kernel_ns, 0, ((size_t)kiln_model_num_kernels + 1) * sizeof *kernel_ns);
        start = now_ns();
        if (kiln_model_run(model, inputs, outputs) != 0) die(1, "the model failed");
        totals[r] = now_ns() - start;
        for (k = 0; k < kiln_model_num_kernels; k++)
            per_run[(size_t)k * (size_t)runs + (size_t)r] = kernel_ns[k];
    }
    if (out_dir)
        for (i = 0; i < kiln_model_num_outputs; i++)
            write_npy(out_dir, i, &kiln_model_outputs[i], outputs[i]);

    rss = peak_rss_bytes();
    printf("{\"threads\": %d, \"warmup\": %ld, \"runs\": %ld, ", kiln_model_threads(model),
           warmup, runs);
    if (rss) printf("\"peak_rss_bytes\": %llu, ", rss);
    printf("\"latency_ns\": {");
    printf("\"median\": %llu, ", (unsigned long long)quantile(totals, (size_t)runs, 0.5));
    printf("\"p10\": %llu, ", (unsigned long long)quantile(totals, (size_t)runs, 0.1));
    printf("\"p90\": %llu, ", (unsigned long long)quantile(totals, (size_t)runs, 0.9));
    printf("\"min\": %llu, \"max\": %llu}, \"kernels\": [", (unsigned long long)totals[0],
           (unsigned long long)totals[runs - 1]);
    for (k = 0; k < kiln_model_num_kernels; k++) {
        const uint64_t *samples = per_run + (size_t)k * (size_t)runs;
        memcpy(column, samples, (size_t)runs * sizeof *column);
        printf("%s{\"index\": %d, \"symbol\": \"%s\", \"block\": \"%s\", \"median_ns\": %llu",
               k ? ", " : "", k, kiln_model_kernels[k].symbol, kiln_model_kernels[k].block,
               (unsigned long long)quantile(column, (size_t)runs, 0.5));
        printf(", \"p10_ns\": %llu", (unsigned long long)quantile(column, (size_t)runs, 0.1));
        printf(", \"p90_ns\": %llu", (unsigned long long)quantile(column, (size_t)runs, 0.9));
        if (runs <= MAX_PRINTED_SAMPLES) {
            printf(", \"samples_ns\": [");
            for (r = 0; r < runs; r++)
                printf("%s%llu", r ? ", " : "", (unsigned long long)samples[r]);
            printf("]");
        }
        printf("}");
    }
    printf("]}\n");
    kiln_model_destroy(model);
    return 0;
}
