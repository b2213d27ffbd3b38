"""Kiln's vectorisable math functions (`kiln.codegen.cmath`) against float64 references.

Each function is compiled the way kernels are (gcc -O3 -fopenmp with the host's flags; and for
aarch64 with the cross compiler, run under qemu-user), called inside a `#pragma omp simd` loop so
the vectorised code is what runs, over adversarial inputs: NaN, ±inf, ±0, denormals, the
overflow and underflow thresholds and their neighbours, the branch points of each function, a
sweep over float bit patterns and dense random values. Results must be within a few ulp of the
correctly rounded value (special values exactly), and the hot loops must vectorise.
"""
from __future__ import annotations

import hashlib
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kiln.codegen import cmath
from kiln.target import host_target, target

BUILD_DIR = Path(tempfile.gettempdir()) / "kiln-cmath-tests"
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")

# (libm name, dtype) -> (max ulp error, float64 reference)
LIMITS: dict[tuple[str, str], float] = {
    ("exp", "float32"): 2, ("log", "float32"): 2, ("log1p", "float32"): 3,
    ("tanh", "float32"): 3, ("erf", "float32"): 6, ("exp", "float64"): 2, ("log", "float64"): 2,
    ("exp_flush", "float32"): 3, ("exp_flush", "float64"): 2, ("gelu_erf", "float32"): 4,
}


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    """x·Φ(x) through erfc, which keeps its relative accuracy for x < 0."""
    return x * 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-x / math.sqrt(2))


REFERENCE = {"exp": np.exp, "log": np.log, "log1p": np.log1p, "tanh": np.tanh, "erf": _erf,
             "exp_flush": np.exp, "gelu_erf": _gelu_erf}


def flushed_tails(x: np.ndarray, y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Where exp_flush<float32> may leave exp: 0 where exp(x) < 2^-126.5 and +inf where
    exp(x) >= 2^127.5 (one scaling by 2^round(x / ln 2)), a rounding either way at each edge."""
    edge = 2.0 ** np.float32(-126.5)
    with np.errstate(over="ignore"):
        low = (ref < edge * 1.0001) & (y == 0) & ~np.signbit(y)
        high = (ref >= 2.0 ** 127.5 / 1.0001) & (y == np.inf)
    return low | high


def _source(main: bool) -> str:
    lines = ["#include <math.h>", "#include <stdint.h>", "#include <string.h>",
             "#include <stdio.h>", "#include <stdlib.h>"]
    lines += [cmath.SOURCES[n] for n in cmath.closure(set(cmath.FUNCTIONS.values()))]
    for (name, dtype), fn in cmath.FUNCTIONS.items():
        t = "float" if dtype == "float32" else "double"
        lines.append(f"void w_{name}_{dtype}(const {t} *restrict x, {t} *restrict y, int64_t n) {{\n"
                     f"  #pragma omp simd\n  for (int64_t i = 0; i < n; ++i) y[i] = {fn}(x[i]);\n}}")
    if main:  # name_dtype size-of-element < input > output
        lines.append("int main(int argc, char **argv) {\n"
                     "  size_t size = (size_t)atoi(argv[2]);\n"
                     "  char *in = malloc(1 << 26), *out = malloc(1 << 26);\n"
                     "  size_t n = fread(in, 1, 1 << 26, stdin) / size;\n")
        for name, dtype in cmath.FUNCTIONS:
            t = "float" if dtype == "float32" else "double"
            w = f"{name}_{dtype}"
            lines.append(f"  if (!strcmp(argv[1], \"{w}\")) w_{w}(({t} *)in, ({t} *)out, n);")
        lines.append("  fwrite(out, size, n, stdout);\n  return 0;\n}")
    return "\n".join(lines) + "\n"


def _build(cc: str, flags: tuple[str, ...], main: bool, suffix: str) -> Path:
    source = _source(main)
    digest = hashlib.sha256((source + cc + " ".join(flags)).encode()).hexdigest()[:16]
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    out = BUILD_DIR / f"m{digest}{suffix}"
    if not out.exists():
        src = out.with_suffix(".c")
        src.write_text(source)
        tmp = out.with_name(out.name + ".tmp")
        subprocess.run([cc, *CFLAGS, *flags, str(src), "-o", str(tmp), "-lm"], check=True,
                       capture_output=True, text=True)
        tmp.rename(out)
    return out


def _host_runner():
    import ctypes
    lib = ctypes.CDLL(str(_build("gcc", (*host_target().cflags, "-shared", "-fPIC"), False, ".so")))

    def run(wrapper: str, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        y = np.empty_like(x)
        getattr(lib, f"w_{wrapper}")(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data),
                                ctypes.c_int64(x.size))
        return y
    return run


def _aarch64_runner():
    if not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")):
        pytest.skip("aarch64 cross compiler or qemu-aarch64 missing")
    exe = _build("aarch64-linux-gnu-gcc", ("-march=armv8-a", "-static"), True, ".aarch64")

    def run(wrapper: str, x: np.ndarray) -> np.ndarray:
        done = subprocess.run(["qemu-aarch64", str(exe), wrapper, str(x.itemsize)],
                              input=np.ascontiguousarray(x).tobytes(), capture_output=True,
                              check=True)
        return np.frombuffer(done.stdout, dtype=x.dtype)
    return run


def inputs(name: str, dtype: str, sweep_stride: int = 4099) -> np.ndarray:
    """Special values, thresholds and their neighbours, a bit-pattern sweep, random values."""
    ft = np.dtype(dtype)
    info = np.finfo(ft)
    it = np.uint32 if dtype == "float32" else np.uint64
    special = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0,
               float(info.tiny), -float(info.tiny), float(info.smallest_subnormal),
               -float(info.smallest_subnormal), float(info.max), -float(info.max),
               float(info.tiny) * 0.75, float(info.eps), 1 + float(info.eps),
               1 - float(info.epsneg), math.sqrt(0.5), math.sqrt(2), 0.625, -0.625, 4.0, -4.0,
               3.9, 3.95, 0.8, 9.0, 10.0, 20.0, 88.0, -88.0, 88.7228, 88.72284, 88.7229, 89.0,
               -87.3365, -87.34, -100.0, -103.97, -103.98, -104.0, -105.0, -150.0, 709.78,
               709.79, 710.0, -708.4, -745.13, -745.14, -746.0, 1e-3, -1e-3, 1e-8, -1e-8, 1e-30]
    base = np.array(special, dtype=np.float64).astype(ft)
    with np.errstate(over="ignore"):
        neighbours = np.concatenate([np.nextafter(base, np.inf), np.nextafter(base, -np.inf)])
    if dtype == "float32":
        sweep = np.arange(0, 2**32, sweep_stride, dtype=np.uint64).astype(it).view(ft)
    else:
        sweep = (np.arange(0, 2**20, dtype=np.uint64) * np.uint64(17592186044399)).astype(
            it).view(ft)
    rng = np.random.default_rng(7)
    scale = {"exp": 100.0, "exp_flush": 100.0, "gelu_erf": 8.0, "log": 10.0, "log1p": 2.0, "tanh": 12.0, "erf": 5.0}[name]
    dense = (rng.uniform(-1, 1, 200_000) * scale).astype(ft)
    small = (rng.uniform(-1, 1, 50_000) * 1e-3).astype(ft)
    near_one = (1 + rng.uniform(-1, 1, 50_000) * 0.3).astype(ft)
    positive = np.exp(rng.uniform(-80, 80, 100_000)).astype(ft)
    return np.concatenate([base, neighbours, sweep, dense, small, near_one, positive, -positive])


def ulp_error(y: np.ndarray, ref: np.ndarray, dtype: str) -> np.ndarray:
    """|y - ref| in units of the spacing of the correctly rounded result (0 where both are the
    same special value, inf where they disagree on NaN or infinity)."""
    ft = np.dtype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = ref.astype(ft)
        finite = np.isfinite(rounded) & np.isfinite(y)
        err = np.where(finite, 0.0, np.inf)
        spacing = np.spacing(np.abs(rounded[finite])).astype(np.float64)
        err[finite] = np.abs(y[finite].astype(np.float64) - ref[finite]) / spacing
        same_special = ~finite & ((np.isnan(y) & np.isnan(rounded)) | (y == rounded))
        err[same_special] = 0.0
    return err


CASES = sorted(cmath.FUNCTIONS)


@pytest.fixture(scope="module")
def host_run():
    return _host_runner()


def _check(run, name: str, dtype: str) -> None:
    x = inputs(name, dtype)
    y = run(f"{name}_{dtype}", x)
    with np.errstate(all="ignore"):
        ref = REFERENCE[name](x.astype(np.float64))
    err = ulp_error(y, ref, dtype)
    if (name, dtype) == ("exp_flush", "float32"):
        err[flushed_tails(x, y, ref)] = 0.0
    if name == "gelu_erf":  # Φ = 0.5·(1 + erf) keeps its absolute error (a few ulp of 0.5) for x < 0
        with np.errstate(invalid="ignore"):
            err[np.abs(y - ref) <= np.abs(x.astype(np.float64)) * 2.0 ** -22] = 0.0
    worst = int(np.argmax(err))
    assert err[worst] <= LIMITS[(name, dtype)], (
        f"{name}<{dtype}>({x[worst]!r}) = {y[worst]!r}, expected {ref[worst]!r}: "
        f"{err[worst]:.2f} ulp")
    # signs of zeros and of infinities
    zero = x == 0
    assert np.array_equal(np.signbit(y[zero & np.isfinite(ref) & (ref == 0)]),
                          np.signbit(ref[zero & np.isfinite(ref) & (ref == 0)].astype(x.dtype)))


@pytest.mark.parametrize("name,dtype", CASES)
def test_host_accuracy(host_run, name, dtype):
    _check(host_run, name, dtype)


@pytest.mark.parametrize("name,dtype", CASES)
def test_aarch64_accuracy(name, dtype):
    _check(_aarch64_runner(), name, dtype)


def test_special_values_exact(host_run):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -1.0, 1.0], dtype=np.float32)
    with np.errstate(all="ignore"):
        for name, dtype in cmath.FUNCTIONS:
            xs = x.astype(dtype)
            y = host_run(f"{name}_{dtype}", xs)
            ref = REFERENCE[name](xs.astype(np.float64)).astype(dtype)
            exact = ~np.isfinite(ref) | (ref == 0) | (ref == 1) | (xs == 0)
            y, ref = y[exact], ref[exact]
            assert np.array_equal(y, ref, equal_nan=True), (name, dtype, xs, y, ref)
            number = ~np.isnan(ref)
            assert np.array_equal(np.signbit(y[number]), np.signbit(ref[number])), (name, dtype, xs)


def test_loops_vectorise(tmp_path):
    """gcc reports every wrapper loop vectorised for the host, for the x86_64 target (AVX2) and
    for aarch64 (NEON). (-fno-ipa-icf: wrappers of one C function, exp_flush<float64> and
    exp<float64>, would otherwise become one's tail call to the other.)"""
    src = tmp_path / "m.c"
    src.write_text(_source(False))
    compilers = [("gcc", host_target().cflags), ("gcc", target("x86_64").cflags)]
    if shutil.which("aarch64-linux-gnu-gcc"):
        compilers.append(("aarch64-linux-gnu-gcc", ("-march=armv8-a",)))
    for cc, flags in compilers:
        done = subprocess.run([cc, *CFLAGS, *flags, "-c", str(src), "-o", str(tmp_path / "m.o"),
                               "-fno-ipa-icf", "-fopt-info-vec-optimized"], capture_output=True, text=True,
                              check=True)
        lines = {ln.split(":")[1] for ln in done.stderr.splitlines() if "loop vectorized" in ln}
        wrappers = [i + 1 for i, ln in enumerate(src.read_text().splitlines())
                    if ln.startswith("  for (int64_t i = 0; i < n; ++i) y[i] = kiln_")]
        assert len(wrappers) == len(cmath.FUNCTIONS)
        missing = [w for w in wrappers if str(w) not in lines]
        assert not missing, (cc, missing, done.stderr[-2000:])


def test_exp_takes_zero_and_infinity_without_underflow_or_overflow(tmp_path):
    """exp of a softmax's masked scores (-inf, -1e30, -FLT_MAX, anything below -104) is 0, and of
    anything above 89 is +inf, taken by a select: no lane underflows or overflows on the way (an
    underflow costs each vector a microcode assist on x86, 2.7x slower), while a NaN stays NaN
    and an input just past -87.3 still underflows gradually to its denormal."""
    src = tmp_path / "flags.c"
    src.write_text("#include <fenv.h>\n" + _source(False) + """
int exp_flags(const float *x, float *y, int64_t n) {
  feclearexcept(FE_ALL_EXCEPT);
  w_exp_float32(x, y, n);
  return (fetestexcept(FE_UNDERFLOW) ? 1 : 0) | (fetestexcept(FE_OVERFLOW) ? 2 : 0);
}
""")
    lib_path = tmp_path / "flags.so"
    subprocess.run(["gcc", *CFLAGS, *host_target().cflags, "-shared", "-fPIC", str(src), "-o",
                    str(lib_path), "-lm"], check=True, capture_output=True, text=True)
    import ctypes
    lib = ctypes.CDLL(str(lib_path))

    def run(values) -> tuple[np.ndarray, int]:
        x = np.ascontiguousarray(np.array(values, dtype=np.float32))
        y = np.empty_like(x)
        flags = lib.exp_flags(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data),
                              ctypes.c_int64(x.size))
        return y, flags

    big = float(np.finfo(np.float32).max)
    outright = [-np.inf, -big, -1e30, -1e4, -105.0, -104.5, np.inf, big, 1e30, 1e4, 90.0, 89.5,
                np.nan, -np.nan, 0.0, -20.0] * 4
    y, flags = run(outright)
    with np.errstate(over="ignore"):
        assert np.array_equal(y, np.exp(np.array(outright, dtype=np.float64)).astype(np.float32),
                              equal_nan=True)
    assert flags == 0, "an outright 0 or +inf was reached by underflow or overflow"
    y, flags = run([-95.0] * 16)
    assert flags & 1 and y[0] == np.float32(np.exp(-95.0)) and y[0] > 0


def test_gelu_erf_factor_stays_in_unit_interval(tmp_path):
    """GELU(x) = x·Φ(x) with Φ in [0, 1] for every float x up to 4√2 in magnitude (the clamp):
    never above x, never positive for x < 0, so GELU(-inf) = -inf·0 = NaN and GELU(x) = x
    beyond the clamp. Every float is tried, vectorised as kernels run it."""
    src = tmp_path / "phi.c"
    src.write_text(_source(False) + """
int64_t outside(void) {
  int64_t count = 0;
  #pragma omp simd reduction(+:count)
  for (uint32_t b = 0; b <= 0x40b504f3u; ++b) {
    float x; memcpy(&x, &b, 4);
    const float up = kiln_gelu_erff(x), down = kiln_gelu_erff(-x);
    count += (up > x) | (up < 0.0f) | (down > 0.0f) | (down < -x);
  }
  return count;
}
""")
    lib_path = tmp_path / "phi.so"
    subprocess.run(["gcc", *CFLAGS, *host_target().cflags, "-shared", "-fPIC", str(src), "-o",
                    str(lib_path), "-lm"], check=True, capture_output=True, text=True)
    import ctypes
    lib = ctypes.CDLL(str(lib_path))
    lib.outside.restype = ctypes.c_int64
    assert lib.outside() == 0
