"""The C-family printer: a kernel's IR, after `kiln.codegen.passes.bind_values`, as source text.

Every expression reaching the printer is a small tree over constants, variables and named values,
printed as it stands; the printer moves and names nothing. What differs between C-family languages
is in tables and a few hooks a renderer overrides (as tinygrad's renderers do): the types, how a
kernel receives its buffers (`signature`, `buffer`), how a parallel loop is mapped
(`parallel_loop`), local array declarations, and the micro-kernels' definitions.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from kiln.codegen import cmath, ir
from kiln.codegen.expr import BOOL, FLOAT_TYPES, INT_TYPES, SIGNED_TYPES, Expr
from kiln.codegen.microkernel import COMPARISONS, MicroKernel

C_TYPES = {
    "float32": "float", "float64": "double", "bool": "uint8_t",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
}
UNSIGNED_OF = {"int32": "uint32_t", "int64": "uint64_t", "uint32": "uint32_t", "uint64": "uint64_t"}
NARROW_INTS = frozenset({"int8", "int16", "uint8", "uint16"})
BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64,
        "uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64}

# Helpers, each behind its own guard so kernels can be concatenated into one file.
HELPERS = {
    "fdiv": "static inline int64_t kiln_fdiv(int64_t a, int64_t b) {\n"
            "  int64_t q = a / b;\n  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;\n}",
    "fmod": "static inline int64_t kiln_fmod(int64_t a, int64_t b) {\n"
            "  int64_t r = a % b;\n  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;\n}",
}


def _int_helpers(dtype: str) -> dict[str, str]:
    t = C_TYPES[dtype]
    signed = dtype in SIGNED_TYPES
    u = UNSIGNED_OF.get(dtype, "uint32_t")
    neg = f"({t})(0u - ({u})a)" if signed else "0"
    div = (f"static inline {t} kiln_div_{dtype}({t} a, {t} b) {{\n"
           f"  return b == 0 ? 0 : {'(b == -1 ? ' + neg + ' : ' if signed else '('}({t})(a / b));\n}}")
    mod_c = (f"static inline {t} kiln_modc_{dtype}({t} a, {t} b) {{\n"
             f"  return (b == 0{' || b == -1' if signed else ''}) ? 0 : ({t})(a % b);\n}}")
    mod_py = (f"static inline {t} kiln_modpy_{dtype}({t} a, {t} b) {{\n"
              f"  {t} r = kiln_modc_{dtype}(a, b);\n"
              + ("  return (r != 0 && ((r < 0) != (b < 0))) ? (" + t + ")(r + b) : r;\n}"
                 if signed else "  return r;\n}"))
    return {f"div_{dtype}": div, f"modc_{dtype}": mod_c, f"modpy_{dtype}": mod_py}


for _dt in sorted(INT_TYPES):
    HELPERS.update(_int_helpers(_dt))


def literal(e: Expr) -> str:
    v = e.value
    dtype = e.dtype
    if dtype in FLOAT_TYPES:
        suffix = "f" if dtype == "float32" else ""
        cast = "(float)" if dtype == "float32" else "(double)"
        if math.isnan(v):
            return f"{cast}NAN"
        if math.isinf(v):
            return f"{cast}INFINITY" if v > 0 else f"(-{cast}INFINITY)"
        text = f"{v:.9g}" if dtype == "float32" else f"{v:.17g}"
        if not any(ch in text for ch in ".e"):
            text += ".0"
        return text + suffix
    if dtype == BOOL:
        return "1" if v else "0"
    bits = BITS[dtype]
    if dtype in SIGNED_TYPES and v == -(1 << (bits - 1)):
        body = f"(-{(1 << (bits - 1)) - 1}{'LL' if bits == 64 else ''} - 1)"
    elif dtype.startswith("uint"):
        body = f"{v}{'ULL' if bits == 64 else 'u'}"
    else:
        body = f"{v}{'LL' if bits == 64 and abs(v) >= 1 << 31 else ''}"
    return body if dtype in ("int32", "int64", "uint32", "uint64") else f"(({C_TYPES[dtype]}){body})"



class CStyleRenderer:
    """Renders one bound `KernelIR` as a translation unit (see `kernel`)."""

    types: dict[str, str] = C_TYPES
    index_type = "int64_t"
    includes: tuple[str, ...] = ("#include <math.h>", "#include <stdint.h>", "#include <string.h>")
    array_align = 64

    def __init__(self) -> None:
        self.launches: tuple = ()  # a GPU renderer's device entry points (kernel.Launch)
        self.helpers: set[str] = set()
        self.math: set[str] = set()  # Kiln's vectorisable math functions used (kiln.codegen.cmath)
        self.micro_kernels: dict[str, str] = {}  # helper function name -> definition
        self.definitions: list[str] = []  # file-scope definitions the kernel needs (in order)

    # --- hooks a renderer overrides ---------------------------------------------------------
    def signature(self, symbol: str) -> str:
        raise NotImplementedError

    def buffer(self, buf: ir.Buffer, position: int, kernel: ir.KernelIR) -> str:
        """The declaration through which the kernel body reaches `buf`."""
        raise NotImplementedError

    def parallel_loop(self, loop: ir.Loop) -> list[str]:
        """Lines before a loop that say how its parallel or vector iterations run."""
        return []

    def micro_kernel(self, kernel: MicroKernel) -> str:
        """The definition of a GEMM micro-kernel function."""
        raise NotImplementedError

    def transpose(self, dtype: str, vector_bytes: int) -> tuple[str, str]:
        """The name and definition of the helper an `ir.Transpose` calls."""
        raise NotImplementedError(f"{type(self).__name__} renders no transposes")

    def local_array(self, stmt: ir.DeclArray) -> str:
        return f"{self.types[stmt.dtype]} {stmt.name}[{stmt.size}];"

    def barrier(self) -> str:
        """A work-group barrier (`ir.Barrier`): only GPU languages have work-groups."""
        raise NotImplementedError(f"{type(self).__name__} renders no work-groups")

    # --- kernel -----------------------------------------------------------------------------
    def kernel(self, kernel: ir.KernelIR, comment: str) -> str:
        body: list[str] = [self.buffer(buf, i, kernel) for i, buf in enumerate(kernel.buffers)]
        for stage in kernel.stages:
            body.append(f"/* {stage.comment} */")
            body.extend(["{", *_indent(self.statements(stage.body)), "}"])
        head = [f"/* {comment} */", *self.includes]
        for name in cmath.closure(self.math):
            head += _guarded(f"KILN_MATH_{name.upper()}", cmath.SOURCES[name])
        for name in sorted(self.helpers):
            head += _guarded(f"KILN_HELPER_{name.upper()}", HELPERS[name])
        for name, text in sorted(self.micro_kernels.items()):
            head += _guarded(f"KILN_HELPER_{name.upper()}", text)
        head += self.definitions
        return "\n".join(head + [self.signature(kernel.symbol) + " {"] + _indent(body) + ["}", ""])

    # --- statements ---------------------------------------------------------------------------
    def statements(self, body: list[ir.Stmt]) -> list[str]:
        lines: list[str] = []
        for stmt in body:
            lines.extend(self.statement(stmt))
        return lines

    def statement(self, stmt: ir.Stmt) -> list[str]:
        x = self.expr
        if isinstance(stmt, ir.Loop):
            return self.loop(stmt)
        if isinstance(stmt, ir.Let):
            return [f"const {self.types[stmt.local.dtype]} {stmt.local.name} = {x(stmt.value)};"]
        if isinstance(stmt, ir.DeclAcc):
            return [f"{self.types[stmt.acc.dtype]} {stmt.acc.name} = {x(stmt.init)};"]
        if isinstance(stmt, ir.Assign):
            return [f"{stmt.acc.name} = {x(stmt.value)};"]
        if isinstance(stmt, ir.DeclArray):
            return [self.local_array(stmt)]
        if isinstance(stmt, ir.ArrayStore):
            return [f"{stmt.name}[{x(stmt.index)}] = {x(stmt.value)};"]
        if isinstance(stmt, ir.Store):
            return [f"{stmt.buffer}[{x(stmt.offset)}] = {x(stmt.value)};"]
        if isinstance(stmt, ir.If):
            lines = [f"if ({x(stmt.cond)}) {{", *_indent(self.statements(stmt.body))]
            if stmt.orelse:
                lines += ["} else {", *_indent(self.statements(stmt.orelse))]
            return lines + ["}"]
        if isinstance(stmt, ir.Barrier):
            return [self.barrier()]
        if isinstance(stmt, ir.MicroKernelCall):
            k = stmt.kernel
            self.micro_kernels.setdefault(k.function, self.micro_kernel(k))
            rows = (str(stmt.ldb) if stmt.rows is None
                    else f"{stmt.rows} + {x(stmt.rows_offset)}")
            ahead = f", {stmt.ahead[0]} + {x(stmt.ahead[1])}" if stmt.ahead else ""
            return [f"{k.function}({x(stmt.kc)}, {stmt.a} + {x(stmt.a_offset)}, {stmt.b} + "
                    f"{x(stmt.b_offset)}, {rows}, {stmt.c} + {x(stmt.c_offset)}, {stmt.ldc}, "
                    f"{x(stmt.accumulate)}{ahead}{self.epilogue_arguments(stmt)});"]
        if isinstance(stmt, ir.Transpose):
            name, source = self.transpose(stmt.dtype, stmt.vector_bytes)
            self.micro_kernels.setdefault(name, source)
            return [f"{name}({stmt.src} + {x(stmt.src_offset)}, {stmt.lds}, {stmt.dst} + "
                    f"{x(stmt.dst_offset)}, {stmt.ldd}, {x(stmt.rows)}, {x(stmt.cols)});"]
        raise TypeError(f"unknown statement {stmt!r}")

    def epilogue_arguments(self, stmt: ir.MicroKernelCall) -> str:
        """The pointers and the finish flag a kernel with a tile epilogue takes after the rest."""
        if stmt.kernel.epilogue is None:
            return ""
        assert stmt.finish is not None
        pointers = "".join(f", {name} + {self.expr(offset)}" for name, offset in stmt.operands)
        return f"{pointers}, {self.expr(stmt.finish)}"

    def loop(self, loop: ir.Loop) -> list[str]:
        v = loop.var.name
        header = (f"for ({self.index_type} {v} = {self.expr(loop.start)}; {v} < "
                  f"{self.expr(loop.stop)}; ++{v}) {{")
        return [*self.parallel_loop(loop), header, *_indent(self.statements(loop.body)), "}"]

    # --- expressions ---------------------------------------------------------------------------
    def expr(self, e: Expr) -> str:
        if e.op == "const":
            return literal(e)
        if e.op in ("var", "local", "acc"):
            return e.name
        return self.render(e, [self.expr(a) for a in e.args])

    def render(self, e: Expr, a: list[str]) -> str:
        """One node over its arguments' text, from the table `OPS`."""
        rule = OPS.get(e.op)
        if rule is None:
            raise ValueError(f"cannot render {e.op}")
        return rule(self, e, a)

    def int_helper(self, name: str, dtype: str) -> None:
        if name == "modpy":
            self.helpers.add(f"modc_{dtype}")
        self.helpers.add(f"{name}_{dtype}")

    def call(self, e: Expr, a: list[str]) -> str:
        own = cmath.function(e.attr, e.dtype)
        if own is not None:
            self.math.add(own)
            return f"{own}({', '.join(a)})"
        libm = cmath.in_libm_terms(e)
        if libm is not e:
            return self.expr(libm)
        fn = e.attr + ("f" if e.dtype == "float32" else "")
        return f"{fn}({', '.join(a)})"


Rule = Callable[[CStyleRenderer, Expr, list[str]], str]


def _fdiv(r: CStyleRenderer, e: Expr, a: list[str]) -> str:
    if e.args[0].range[0] >= 0:
        return f"({a[0]} / {e.attr})"
    r.helpers.add("fdiv")
    return f"kiln_fdiv({a[0]}, {e.attr})"


def _fmod(r: CStyleRenderer, e: Expr, a: list[str]) -> str:
    if e.args[0].range[0] >= 0:
        return f"({a[0]} % {e.attr})"
    r.helpers.add("fmod")
    return f"kiln_fmod({a[0]}, {e.attr})"


def _div(r: CStyleRenderer, e: Expr, a: list[str]) -> str:
    if e.dtype in FLOAT_TYPES:
        return f"({a[0]} / {a[1]})"
    r.int_helper("div", e.dtype)
    return f"kiln_div_{e.dtype}({a[0]}, {a[1]})"


def _mod(r: CStyleRenderer, e: Expr, a: list[str]) -> str:
    if e.dtype in FLOAT_TYPES:
        fn = "fmodf" if e.dtype == "float32" else "fmod"
        if e.op == "mod_c":
            return f"{fn}({a[0]}, {a[1]})"
        return (f"({fn}({a[0]}, {a[1]}) != 0 && (({fn}({a[0]}, {a[1]}) < 0) != ({a[1]} < 0))"
                f" ? {fn}({a[0]}, {a[1]}) + {a[1]} : {fn}({a[0]}, {a[1]}))")
    name = "modc" if e.op == "mod_c" else "modpy"
    r.int_helper(name, e.dtype)
    return f"kiln_{name}_{e.dtype}({a[0]}, {a[1]})"


def _min_max(r: CStyleRenderer, e: Expr, a: list[str]) -> str:
    cmp = "<" if e.op == "min" else ">"
    if e.dtype in FLOAT_TYPES:
        return f"(({a[0]} {cmp} {a[1]} || {a[0]} != {a[0]}) ? {a[0]} : {a[1]})"
    return f"({a[0]} {cmp} {a[1]} ? {a[0]} : {a[1]})"


def _neg(r: CStyleRenderer, e: Expr, a: list[str]) -> str:
    if e.dtype in FLOAT_TYPES:
        return f"(-{a[0]})"
    return _wrapping(e.dtype, "{0} - {1}", ["0", a[0]])


def _abs(r: CStyleRenderer, e: Expr, a: list[str]) -> str:
    dtype = e.dtype
    if dtype in FLOAT_TYPES:
        return f"{'fabsf' if dtype == 'float32' else 'fabs'}({a[0]})"
    if dtype.startswith("uint"):
        return a[0]
    return f"({a[0]} < 0 ? {_wrapping(dtype, '{0} - {1}', ['0', a[0]])} : {a[0]})"


def _bitcast(r: CStyleRenderer, e: Expr, a: list[str]) -> str:
    t, source = r.types[e.dtype], r.types[e.args[0].dtype]
    return (f"({{ {t} bits_; const {source} from_ = {a[0]}; "
            f"memcpy(&bits_, &from_, sizeof bits_); bits_; }})")


def _bitwise(symbol: str) -> Rule:
    return lambda r, e, a: f"(({r.types[e.dtype]})({a[0]} {symbol} {a[1]}))"


def _arith(symbol: str) -> Rule:
    return lambda r, e, a: _wrapping(e.dtype, f"{{0}} {symbol} {{1}}", a)


def _compare(symbol: str) -> Rule:
    return lambda r, e, a: f"({a[0]} {symbol} {a[1]})"


OPS: dict[str, Rule] = {
    "load": lambda r, e, a: f"{e.name}[{a[0]}]",
    "lload": lambda r, e, a: f"{e.name}[{a[0]}]",
    "sum": lambda r, e, a: _render_sum(e, a),
    "fdiv": _fdiv,
    "fmod": _fmod,
    "imul": lambda r, e, a: f"({a[0]} * {a[1]})",
    **{op: _compare(symbol) for op, symbol in COMPARISONS.items()},
    "and": _compare("&&"),
    "or": _compare("||"),
    "xor": _compare("!="),
    "not": lambda r, e, a: f"(!{a[0]})",
    "select": lambda r, e, a: f"({a[0]} ? {a[1]} : {a[2]})",
    "cast": lambda r, e, a: _render_cast(e.args[0].dtype, e.dtype, a[0]),
    "add": _arith("+"),
    "sub": _arith("-"),
    "mul": _arith("*"),
    "neg": _neg,
    "div": _div,
    "mod_c": _mod,
    "mod_py": _mod,
    "min": _min_max,
    "max": _min_max,
    "abs": _abs,
    "bitand": _bitwise("&"),
    "bitor": _bitwise("|"),
    "bitxor": _bitwise("^"),
    "bitnot": lambda r, e, a: f"(({r.types[e.dtype]})(~{a[0]}))",
    "shl": lambda r, e, a: _render_shift(e.op, e.dtype, a),
    "shr": lambda r, e, a: _render_shift(e.op, e.dtype, a),
    "bitcast": _bitcast,
    "call": lambda r, e, a: r.call(e, a),
}


def _guarded(guard: str, text: str) -> list[str]:
    """A definition behind its own guard, so kernels can be concatenated into one file."""
    return [f"#ifndef {guard}", f"#define {guard}", text, "#endif"]


def _render_sum(e: Expr, a: list[str]) -> str:
    coefs, c = e.attr
    parts: list[str] = []
    for text, k in zip(a, coefs):
        mag = abs(k)
        term = text if mag == 1 else f"{text} * {mag}"
        parts.append(("- " if k < 0 else "+ ") + term)
    if c:
        parts.append(("- " if c < 0 else "+ ") + str(abs(c)))
    first = parts[0]
    body = (first[2:] if first.startswith("+") else "-" + first[2:]) + "".join(" " + p for p in parts[1:])
    return f"({body})"


def _wrapping(dtype: str, pattern: str, a: list[str]) -> str:
    """Integer arithmetic that wraps around like ONNX runtimes do, without C's signed-overflow UB."""
    t = C_TYPES[dtype]
    if dtype in FLOAT_TYPES:
        return "(" + pattern.format(*a) + ")"
    if dtype in NARROW_INTS or dtype == BOOL:
        return f"(({t})(" + pattern.format(*a) + "))"
    u = UNSIGNED_OF[dtype]
    return f"(({t})(" + pattern.format(*(f"({u}){x}" for x in a)) + "))"


def _render_shift(op: str, dtype: str, a: list[str]) -> str:
    """ONNX BitShift: a shift by a negative amount or by the bit width or more gives 0, or -1 for
    an arithmetic right shift of a negative value (numpy's saturating semantics)."""
    t = C_TYPES[dtype]
    signed = dtype in SIGNED_TYPES
    out_of_range = f"({a[1]} >= {BITS[dtype]}" + (f" || {a[1]} < 0)" if signed else ")")
    if op == "shl":
        shifted = f"({t})((uint64_t)({a[0]}) << {a[1]})"
        saturated = f"({t})0"
    else:
        shifted = f"({t})({a[0]} >> {a[1]})"
        saturated = f"({a[0]} < 0 ? ({t})-1 : ({t})0)" if signed else f"({t})0"
    return f"({out_of_range} ? {saturated} : {shifted})"


def _render_cast(src: str, dst: str, a: str) -> str:
    t = C_TYPES[dst]
    if dst == BOOL:
        return f"(({a}) != 0)"
    if src in FLOAT_TYPES and dst in INT_TYPES:
        if dst in NARROW_INTS:
            return f"(({t})(int32_t)({a}))"
        if dst == "uint32":
            return f"(({t})(int64_t)({a}))"
    return f"(({t})({a}))"


def _indent(lines: list[str]) -> list[str]:
    return ["  " + line if line else line for line in lines]

