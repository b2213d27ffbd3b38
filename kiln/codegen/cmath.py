"""Kiln's own elementary functions for generated C: inline, branch-free, vectorisable.

Without -ffast-math the C compiler vectorises no loop that calls libm's expf/logf/tanhf/erff (each
is an opaque call that may set errno), so softmax, GELU, tanh, sigmoid, softplus and friends
would run one element at a time inside their `#pragma omp simd` loops. The functions here are
plain C: integer and float arithmetic on bit patterns, with every special case chosen by a select
rather than a branch, so gcc inlines them and vectorises the loop for AVX2/AVX-512 and NEON alike.

Accuracy (float32, against float64 references; `tests/codegen/test_cmath.py` checks it over
special values, boundaries, denormals and a sweep of every 251st bit pattern):

* exp: Cody–Waite reduction by ln 2, Cephes' degree-6 polynomial; overflow to +inf above
  88.72, gradual underflow to denormals and 0 below -87.3 (the scale is applied as two halves so
  that 2^n never leaves the normal range); at most 2 ulp. Inputs whose result is 0 or +inf
  outright (a softmax's masked scores) take it by a select, never by an underflow.
* exp_flush (a term of 1 + exp(x): sigmoid, SiLU, GELU): exp's polynomial on |x| clamped to 89,
  scaled once by 2^n with the exponent field stopped at 0, and a degree-5 polynomial: 0 where
  exp(x) < 2^-126.5, +inf where exp(x) >= 2^127.5, at most 3 ulp between; float64 uses exp.
* log: mantissa reduced to [√½, √2) from the bits (denormals scaled first), Cephes' polynomial;
  log(±0) = -inf, log(x<0) = NaN, log(+inf) = +inf; at most 2 ulp.
* log1p: log(u)·x/(u-1) with u = 1+x (Goldberg's trick), exact for tiny x; at most 3 ulp.
* tanh: odd polynomial below 0.625, 1 - 2/(e^{2|x|}+1) above; at most 3 ulp.
* erf: x·P(x²)/Q(x²) on x clamped to [-4, 4] (erf rounds to ±1 beyond), the rational
  approximation XLA and Eigen use (product taken as x·(P/Q), exact for denormals); at most
  6 ulp (3.4e-7 absolute, next to ±1).
* gelu_erf, x·Φ(x) with Φ(x) = 0.5·(1 + erf(x/√2)): erf's rational with the 1/√2 and the 0.5
  folded into its coefficients, Φ clamped to [0, 1] on the bits; within 4 ulp, or |x|·2^-22
  for x < 0 (Φ's absolute error, as x·0.5·(1 + erf) has it).
* float64 exp and log: the same reductions with Cephes' double-precision rational
  approximations; at most 2 ulp. Other float64 functions stay libm calls.

NaN propagates through every function (every comparison on a NaN is false, so the selects fall
through to arithmetic on the NaN). Every operation is evaluated unconditionally and every choice is made on integers: clamps and
special cases compare the bit patterns, and selects merge bit masks (`kiln_self`). Under gcc's
default -ftrapping-math a float comparison may trap, so a select on one is not always
if-converted (aarch64 and AVX2 refuse where AVX-512 accepts), and the loop would not vectorise. Every function is `static inline` behind its own include guard
in the kernel source, so kernels concatenated into one file still compile.
"""
from __future__ import annotations

import math

from kiln.codegen.expr import Expr, binary, call, const

# C name of each function by (libm name, dtype). The emitter uses these instead of libm calls.
FUNCTIONS: dict[tuple[str, str], str] = {
    ("exp", "float32"): "kiln_expf",
    ("log", "float32"): "kiln_logf",
    ("log1p", "float32"): "kiln_log1pf",
    ("tanh", "float32"): "kiln_tanhf",
    ("erf", "float32"): "kiln_erff",
    ("gelu_erf", "float32"): "kiln_gelu_erff",
    ("exp_flush", "float32"): "kiln_expf_flush",
    ("exp", "float64"): "kiln_exp",
    ("exp_flush", "float64"): "kiln_exp",
    ("log", "float64"): "kiln_log",
}
_INLINE = "static inline __attribute__((always_inline))"

_BITS = f"""{_INLINE} int32_t kiln_f2i(float f) {{ int32_t i; memcpy(&i, &f, 4); return i; }}
{_INLINE} float kiln_i2f(int32_t i) {{ float f; memcpy(&f, &i, 4); return f; }}
{_INLINE} int64_t kiln_d2i(double f) {{ int64_t i; memcpy(&i, &f, 8); return i; }}
{_INLINE} double kiln_i2d(int64_t i) {{ double f; memcpy(&f, &i, 8); return f; }}
/* cond ? a : b by bit masks (cond is 0 or 1 from integer comparisons) */
{_INLINE} int32_t kiln_seli(int32_t cond, int32_t a, int32_t b) {{ return (-cond & a) | ((cond - 1) & b); }}
{_INLINE} int64_t kiln_seli64(int64_t cond, int64_t a, int64_t b) {{ return (-cond & a) | ((cond - 1) & b); }}
{_INLINE} float kiln_self(int32_t cond, float a, float b) {{
  return kiln_i2f(kiln_seli(cond, kiln_f2i(a), kiln_f2i(b))); }}
{_INLINE} double kiln_sel(int64_t cond, double a, double b) {{
  return kiln_i2d(kiln_seli64(cond, kiln_d2i(a), kiln_d2i(b))); }}"""

_EXPF = f"""{_INLINE} float kiln_expf(float x) {{
  /* x < -104 (exp rounds to 0) and x > 89 (to +inf), found on the bits (a negative float's bits
     grow with its magnitude as an integer; a NaN is neither), run exp(0) and take their result
     at the end: an underflow on the way would cost each vector a microcode assist on x86 */
  const int32_t bits = kiln_f2i(x);
  const int32_t zero = (bits > (int32_t)0xc2d00000) & (bits <= (int32_t)0xff800000);
  const int32_t inf = (bits > 0x42b20000) & (bits <= 0x7f800000);
  const float xc = kiln_i2f(bits & ((zero | inf) - 1));
  /* n = round(x / ln2) by the 1.5*2^23 trick: n lands in the low bits of t */
  const float t = xc * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  const int32_t k = kiln_f2i(t) - 0x4b400000;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  /* 2^n as two normal halves: n in [-150, 128] */
  const int32_t k1 = k >> 1;
  const int32_t k2 = k - k1;
  const float res = (p * kiln_i2f((k1 + 127) << 23)) * kiln_i2f((k2 + 127) << 23);
  return kiln_i2f(kiln_seli(zero, 0, kiln_seli(inf, 0x7f800000, kiln_f2i(res))));
}}"""

_EXPF_FLUSH = f"""{_INLINE} float kiln_expf_flush(float x) {{
  /* kiln_expf's reduction and polynomial without its tails: |x| clamped to 89 on the bits (a NaN
     stays NaN) and 2^n applied as one scaling whose exponent field stops at 0 */
  const int32_t bits = kiln_f2i(x), mag = bits & 0x7fffffff;
  const float xc = kiln_i2f(kiln_seli((mag > 0x42b20000) & (mag <= 0x7f800000),
                                      0x42b20000 | (bits & (int32_t)0x80000000), bits));
  const float t = xc * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  const int32_t field = kiln_f2i(t) - 0x4b400000 + 127; /* n + 127, in [-1, 255] */
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 8.312523365020752e-3f; /* degree 5, minimax of relative error on [-ln2/2, ln2/2] */
  p = p * r + 4.1890114545822144e-2f;
  p = p * r + 1.6667114198207855e-1f;
  p = p * r + 4.99992311000824e-1f;
  p = p * (r * r) + r + 1.0f;
  return p * kiln_i2f((field > 0 ? field : 0) << 23); /* n = 128: +inf */
}}"""

_LOGF = f"""{_INLINE} float kiln_logf(float x) {{
  const int32_t bits = kiln_f2i(x);
  const int32_t tiny = bits < 0x00800000; /* denormal, zero or negative: 0 or 1 */
  const float scaled = x * 8388608.0f;
  const float xs = kiln_self(tiny, scaled, x);
  int32_t ix = kiln_f2i(xs) - 0x3f3504f3; /* exponent relative to sqrt(1/2) */
  const int32_t e = (ix >> 23) - (-tiny & 23);
  ix = (ix & 0x007fffff) + 0x3f3504f3;
  const float f = kiln_i2f(ix) - 1.0f; /* in [sqrt(1/2) - 1, sqrt(2) - 1) */
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  const float ef = (float)e;
  y = y + ef * -2.12194440e-4f;
  y = y - 0.5f * z;
  const float res = (f + y) + ef * 0.693359375f;
  /* special cases merged by bit masks: a select of floats here lets gcc sink the polynomial
     into a branch, and the loop would not vectorise */
  const int32_t special = kiln_seli(bits >= 0x7f800000, bits,            /* +inf, +NaN */
                                    kiln_seli((bits & 0x7fffffff) == 0,
                                              (int32_t)0xff800000,       /* ±0: -inf */
                                              0x7fc00000));              /* x < 0: NaN */
  return kiln_i2f(kiln_seli((bits <= 0) | (bits >= 0x7f800000), special, kiln_f2i(res)));
}}"""

_LOG1PF = f"""{_INLINE} float kiln_log1pf(float x) {{
  const float u = 1.0f + x;
  const float d = u - 1.0f;
  const float general = kiln_logf(u) * (x / d);
  /* x itself where 1 + x rounds to 1 and for +inf, merged by a bit mask (see kiln_logf) */
  const int32_t bits = kiln_f2i(x);
  return kiln_self(((kiln_f2i(d) & 0x7fffffff) == 0) | (bits == 0x7f800000), x, general);
}}"""

_TANHF = f"""{_INLINE} float kiln_tanhf(float x) {{
  const int32_t bits = kiln_f2i(x), mag = bits & 0x7fffffff;
  const float a = kiln_i2f(mag);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = kiln_self(mag == 0, x, x + x * z * p); /* tanh(-0) = -0 */
  const float e = kiln_expf(2.0f * a);
  const float big = 1.0f - 2.0f / (e + 1.0f); /* in [0, 1], or NaN */
  const float signed_big = kiln_i2f(kiln_f2i(big) | (bits & (int32_t)0x80000000));
  return kiln_self(mag < 0x3f200000, small, signed_big); /* |x| < 0.625 */
}}"""

_ERFF = f"""{_INLINE} float kiln_erff(float x) {{
  /* clamp |x| to 4 on the bits (erf rounds to ±1 beyond; a NaN stays NaN) */
  const int32_t bits = kiln_f2i(x), mag = bits & 0x7fffffff, sign = bits & (int32_t)0x80000000;
  const float xc = kiln_i2f(kiln_seli((mag > 0x40800000) & (mag <= 0x7f800000), 0x40800000 | sign,
                                      bits));
  const float z = xc * xc;
  float p = -2.72614225801306e-10f;
  p = p * z + 2.77068142495902e-08f;
  p = p * z - 2.10102402082508e-06f;
  p = p * z - 5.69250639462346e-05f;
  p = p * z - 7.34990630326855e-04f;
  p = p * z - 2.95459980854025e-03f;
  p = p * z - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * z - 2.13374055278905e-04f;
  q = q * z - 1.68282697438203e-03f;
  q = q * z - 7.37332916720468e-03f;
  q = q * z - 1.42647390514189e-02f;
  const float res = xc * (p / q);
  const int32_t rbits = kiln_f2i(res), rmag = rbits & 0x7fffffff;
  return kiln_i2f(kiln_seli((rmag > 0x3f800000) & (rmag <= 0x7f800000), 0x3f800000 | sign, rbits));
}}"""

_GELU_ERFF = f"""{_INLINE} float kiln_gelu_erff(float x) {{
  /* x·Φ(x) with Φ(x) = 0.5·(1 + erf(x/√2)) = 0.5 + xc·P(xc²)/Q(xc²): kiln_erff's rational at
     x/√2 with the 1/√2 and the 0.5 folded into its coefficients; |x| clamped to 4√2 on the bits
     (erf is ±1 beyond; a NaN stays NaN) */
  const int32_t bits = kiln_f2i(x), mag = bits & 0x7fffffff;
  const float xc = kiln_i2f(kiln_seli((mag > 0x40b504f3) & (mag <= 0x7f800000),
                                      0x40b504f3 | (bits & (int32_t)0x80000000), bits));
  const float z = xc * xc;
  float p = -1.50599509e-12f;
  p = p * z + 3.06119935e-10f;
  p = p * z - 4.64265106e-08f;
  p = p * z - 2.51575625e-06f;
  p = p * z - 6.49646099e-05f;
  p = p * z - 0.000522304385f;
  p = p * z - 0.00569080701f;
  float q = -9.1037947e-07f;
  q = q * z - 2.66717561e-05f;
  q = q * z - 0.000420706754f;
  q = q * z - 0.00368666463f;
  q = q * z - 0.0142647391f;
  /* Φ clamped to [0, 1] on the bits (the rational's last ulp may leave it): GELU(x) = x beyond
     4√2, -0 below -4√2, and GELU(-inf) = -inf·0 = NaN as x·0.5·(1 + erf) gives */
  const int32_t phi = kiln_f2i(0.5f + xc * (p / q));
  const int32_t nonnegative = phi & ~(phi >> 31);
  return x * kiln_i2f(nonnegative < 0x3f800000 ? nonnegative : 0x3f800000);
}}"""

_EXP = f"""{_INLINE} double kiln_exp(double x) {{
  /* clamp to [-746, 710] on the bits (a NaN stays NaN) */
  const int64_t bits = kiln_d2i(x), mag = bits & 0x7fffffffffffffffLL;
  const int64_t lo = (bits < 0) & (mag > 0x4087500000000000LL) & (mag <= 0x7ff0000000000000LL);
  const int64_t hi = (bits > 0x4086300000000000LL) & (bits <= 0x7ff0000000000000LL);
  const double xc = kiln_i2d(kiln_seli64(lo, (int64_t)0xc087500000000000ULL,
                                         kiln_seli64(hi, 0x4086300000000000LL, bits)));
  const double t = xc * 1.4426950408889634074 + 6755399441055744.0;
  const double n = t - 6755399441055744.0;
  const int32_t k = (int32_t)(kiln_d2i(t) - kiln_d2i(6755399441055744.0));
  double r = xc - n * 6.93145751953125E-1;
  r = r - n * 1.42860682030941723212E-6;
  const double rr = r * r;
  double p = 1.26177193074810590878E-4;
  p = p * rr + 3.02994407707441961300E-2;
  p = p * rr + 9.99999999999999999910E-1;
  p = p * r;
  double q = 3.00198505138664455042E-6;
  q = q * rr + 2.52448340349684104192E-3;
  q = q * rr + 2.27265548208155028766E-1;
  q = q * rr + 2.00000000000000000009E0;
  const double e = 1.0 + 2.0 * (p / (q - p));
  const int32_t k1 = k >> 1;
  const int32_t k2 = k - k1;
  return (e * kiln_i2d((int64_t)(k1 + 1023) << 52)) * kiln_i2d((int64_t)(k2 + 1023) << 52);
}}"""

_LOG = f"""{_INLINE} double kiln_log(double x) {{
  const int64_t bits = kiln_d2i(x);
  const int64_t tiny = bits < 0x0010000000000000LL; /* denormal, zero or negative */
  const double scaled = x * 18014398509481984.0; /* 2^54 */
  const double xs = kiln_sel(tiny, scaled, x);
  int64_t ix = kiln_d2i(xs) - 0x3fe6a09e667f3bcdLL; /* exponent relative to sqrt(1/2) */
  const int32_t e = (int32_t)(ix >> 52) - ((int32_t)-tiny & 54); /* int32: AVX2 has no int64 -> double */
  ix = (ix & 0x000fffffffffffffLL) + 0x3fe6a09e667f3bcdLL;
  const double f = kiln_i2d(ix) - 1.0; /* in [sqrt(1/2) - 1, sqrt(2) - 1) */
  const double z = f * f;
  double p = 1.01875663804580931796E-4;
  p = p * f + 4.97494994976747001425E-1;
  p = p * f + 4.70579119878881725854E0;
  p = p * f + 1.44989225341610930846E1;
  p = p * f + 1.79368678507819816313E1;
  p = p * f + 7.70838733755885391666E0;
  double q = f + 1.12873587189167450590E1;
  q = q * f + 4.52279145837532221105E1;
  q = q * f + 8.29875266912776603211E1;
  q = q * f + 7.11544750618563894466E1;
  q = q * f + 2.31251620126765340583E1;
  const double ed = (double)e;
  double y = f * (z * p / q);
  y = y + ed * -2.121944400546905827679e-4;
  y = y - 0.5 * z;
  const double res = (f + y) + ed * 0.693359375;
  const int64_t special = kiln_seli64(bits >= 0x7ff0000000000000LL, bits,      /* +inf, +NaN */
                                      kiln_seli64((bits & 0x7fffffffffffffffLL) == 0,
                                                  (int64_t)0xfff0000000000000ULL, /* ±0: -inf */
                                                  0x7ff8000000000000LL));         /* x < 0: NaN */
  return kiln_i2d(kiln_seli64((bits <= 0) | (bits >= 0x7ff0000000000000LL), special,
                              kiln_d2i(res)));
}}"""

# Helper sources by name, and the helpers each one uses (emitted first).
SOURCES: dict[str, str] = {
    "kiln_bits": _BITS,
    "kiln_expf": _EXPF,
    "kiln_expf_flush": _EXPF_FLUSH,
    "kiln_logf": _LOGF,
    "kiln_log1pf": _LOG1PF,
    "kiln_tanhf": _TANHF,
    "kiln_erff": _ERFF,
    "kiln_gelu_erff": _GELU_ERFF,
    "kiln_exp": _EXP,
    "kiln_log": _LOG,
}
DEPENDS: dict[str, tuple[str, ...]] = {
    "kiln_expf": ("kiln_bits",),
    "kiln_expf_flush": ("kiln_bits",),
    "kiln_logf": ("kiln_bits",),
    "kiln_log1pf": ("kiln_bits", "kiln_logf"),
    "kiln_tanhf": ("kiln_expf",),
    "kiln_erff": ("kiln_bits",),
    "kiln_gelu_erff": ("kiln_bits",),
    "kiln_exp": ("kiln_bits",),
    "kiln_log": ("kiln_bits",),
}


def in_libm_terms(e: Expr) -> Expr:
    """A call of one of Kiln's own functions in libm's, for a renderer (a GPU language) or dtype
    without Kiln's C; any other expression as it stands. exp_flush is exp whose results below the
    normal range may be 0 and above 2^127.5 +inf (a term of 1 + exp(x), which absorbs both);
    gelu_erf is GELU, 0.5·x·(1 + erf(x/√2))."""
    if e.op != "call" or e.attr not in ("exp_flush", "gelu_erf"):
        return e
    x = e.args[0]
    if e.attr == "exp_flush":
        return call("exp", e.dtype, x)
    erf = call("erf", e.dtype, binary("mul", x, const(math.sqrt(0.5), e.dtype)))
    return binary("mul", binary("mul", const(0.5, e.dtype), x), binary("add", const(1, e.dtype), erf))


def function(name: str, dtype: str) -> str | None:
    """Kiln's C function for libm's `name` at `dtype`, or None (then the libm call stays)."""
    return FUNCTIONS.get((name, dtype))


def closure(names: set[str] | list[str]) -> list[str]:
    """The helpers `names` need, each after the helpers it uses."""
    order: list[str] = []

    def visit(n: str) -> None:
        if n in order:
            return
        for d in DEPENDS.get(n, ()):
            visit(d)
        order.append(n)

    for n in sorted(names):
        visit(n)
    return order
