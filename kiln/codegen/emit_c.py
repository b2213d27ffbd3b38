"""IR → C with OpenMP, for x86-64 and aarch64 alike (the same portable C; the target only picks
compiler flags, which the toolchain adds).

Expressions are emitted as `const` temporaries, each once per scope (common sub-expressions), and
each at the outermost loop level where every variable it reads is defined (loop-invariant code
motion): a bias load `b[c]` sits in the channel loop, not in the pixel loop. Nodes that read
mutable state (accumulators, local arrays, buffers the stage itself writes) are rendered inline
where they are used. `if` bodies are barriers: nothing computed under a condition moves above it.
"""
from __future__ import annotations

import math

from kiln.codegen import cmath, ir
from kiln.codegen.expr import BOOL, FLOAT_TYPES, INT_TYPES, SIGNED_TYPES, Expr

C_TYPES = {
    "float32": "float", "float64": "double", "bool": "uint8_t",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
}
UNSIGNED_OF = {"int32": "uint32_t", "int64": "uint64_t", "uint32": "uint32_t", "uint64": "uint64_t"}
NARROW_INTS = frozenset({"int8", "int16", "uint8", "uint16"})
BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64,
        "uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64}
COMPARISONS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
ARRAY_ALIGN = 64

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


class _Scope:
    def __init__(self, parent: _Scope | None, defines: set[Expr], barrier: bool = False):
        self.parent = parent
        self.defines = defines
        self.barrier = barrier
        self.lines: list[str] = []
        self.names: dict[Expr, str] = {}
        # temporaries of values that read mutable state, valid until that state is written
        self.mutable: dict[Expr, str] = {}

    def written(self, names: set[str], depends: dict[Expr, frozenset[str]]) -> None:
        """State `names` changed: forget the temporaries that read it."""
        for e in [e for e in self.mutable if depends[e] & names]:
            del self.mutable[e]

    def lookup(self, e: Expr) -> str | None:
        scope: _Scope | None = self
        while scope is not None:
            if e in scope.names:
                return scope.names[e]
            scope = scope.parent
        return None


class CEmitter:
    """Renders one `KernelIR` as a C translation unit defining `void symbol(void *const *args)`."""

    def __init__(self) -> None:
        self.helpers: set[str] = set()
        self.math: set[str] = set()  # Kiln's vectorisable math functions used (kiln.codegen.cmath)
        self.micro_kernels: dict[str, str] = {}  # function name -> definition
        self.counter = 0
        self.written: set[str] = set()  # buffers the current stage stores to
        self.depends: dict[Expr, frozenset[str]] = {}  # the mutable state each node reads

    # --- kernel -----------------------------------------------------------------------------
    def kernel(self, kernel: ir.KernelIR, comment: str) -> str:
        body: list[str] = []
        for i, buf in enumerate(kernel.buffers):
            body.append(self._pointer(buf, i, kernel))
        for stage in kernel.stages:
            body.append(f"/* {stage.comment} */")
            body.extend(self.stage(stage))
        head = [f"/* {comment} */", "#include <math.h>", "#include <stdint.h>", "#include <string.h>"]
        for name in cmath.closure(self.math):
            guard = f"KILN_MATH_{name.upper()}"
            head += [f"#ifndef {guard}", f"#define {guard}", cmath.SOURCES[name], "#endif"]
        for name in sorted(self.helpers):
            guard = f"KILN_HELPER_{name.upper()}"
            head += [f"#ifndef {guard}", f"#define {guard}", HELPERS[name], "#endif"]
        for name, text in sorted(self.micro_kernels.items()):
            guard = f"KILN_HELPER_{name.upper()}"
            head += [f"#ifndef {guard}", f"#define {guard}", text, "#endif"]
        text = head + [f"void {kernel.symbol}(void *const *args) {{"] + _indent(body) + ["}", ""]
        return "\n".join(text)

    def _pointer(self, buf: ir.Buffer, position: int, kernel: ir.KernelIR) -> str:
        t = C_TYPES[buf.dtype]
        if buf.role == "input":
            return f"const {t} *restrict {buf.name} = (const {t} *)args[{position}];"
        if buf.role == "output":
            return f"{t} *restrict {buf.name} = ({t} *)args[{position}];"
        scratch_arg = sum(1 for b in kernel.buffers if b.role != "scratch")
        return (f"{t} *restrict {buf.name} = ({t} *)((char *)args[{scratch_arg}] + "
                f"{buf.scratch_offset});")

    # --- stages and statements ---------------------------------------------------------------
    def stage(self, stage: ir.Stage) -> list[str]:
        self.written = {s.buffer for s in ir.iter_stmts(stage.body) if isinstance(s, ir.Store)}
        self.depends = {}
        scope = _Scope(None, set(), barrier=True)
        for stmt in stage.body:
            self.statement(stmt, scope)
        return ["{"] + _indent(scope.lines) + ["}"]

    def statement(self, stmt: ir.Stmt, scope: _Scope) -> None:
        self._emit(stmt, scope)
        changed = _writes(stmt)
        if changed:
            scope.written(changed, self.depends)

    def _emit(self, stmt: ir.Stmt, scope: _Scope) -> None:
        if isinstance(stmt, ir.Loop):
            self.loop(stmt, scope)
        elif isinstance(stmt, ir.Let):
            value = self.ref(stmt.value, scope)
            scope.lines.append(f"const {C_TYPES[stmt.local.dtype]} {stmt.local.name} = {value};")
            scope.defines.add(stmt.local)
        elif isinstance(stmt, ir.DeclAcc):
            init = self.ref(stmt.init, scope)
            scope.lines.append(f"{C_TYPES[stmt.acc.dtype]} {stmt.acc.name} = {init};")
            scope.defines.add(stmt.acc)
        elif isinstance(stmt, ir.Assign):
            scope.lines.append(f"{stmt.acc.name} = {self.ref(stmt.value, scope)};")
        elif isinstance(stmt, ir.DeclArray):
            scope.lines.append(f"{C_TYPES[stmt.dtype]} {stmt.name}[{stmt.size}] "
                               f"__attribute__((aligned({ARRAY_ALIGN})));")
        elif isinstance(stmt, ir.ArrayStore):
            index, value = self.ref(stmt.index, scope), self.ref(stmt.value, scope)
            scope.lines.append(f"{stmt.name}[{index}] = {value};")
        elif isinstance(stmt, ir.Store):
            offset, value = self.ref(stmt.offset, scope), self.ref(stmt.value, scope)
            scope.lines.append(f"{stmt.buffer}[{offset}] = {value};")
        elif isinstance(stmt, ir.If):
            self.branch(stmt, scope)
        elif isinstance(stmt, ir.MicroKernelCall):
            self.micro_kernel(stmt, scope)
        else:
            raise TypeError(f"unknown statement {stmt!r}")

    def loop(self, loop: ir.Loop, scope: _Scope) -> None:
        nest = [loop]
        for _ in range(loop.parallel - 1):
            inner = nest[-1].body
            assert len(inner) == 1 and isinstance(inner[0], ir.Loop), "collapse needs a perfect nest"
            nest.append(inner[0])
        headers = []
        for level in nest:
            start, stop = self.ref(level.start, scope), self.ref(level.stop, scope)
            v = level.var.name
            headers.append(f"for (int64_t {v} = {start}; {v} < {stop}; ++{v}) {{")
        inner_loop = nest[-1]
        child = _Scope(scope, {level.var for level in nest})
        for stmt in inner_loop.body:
            self.statement(stmt, child)
        pragma = self._pragma(loop, inner_loop)
        if pragma:
            scope.lines.append(pragma)
        text = child.lines
        for header in reversed(headers):
            text = [header] + _indent(text) + ["}"]
        scope.lines.extend(text)

    def _pragma(self, loop: ir.Loop, inner: ir.Loop) -> str:
        clauses = []
        if loop.parallel:
            clauses.append("parallel for")
            if loop.simd and loop.parallel == 1:
                clauses.append("simd")
            clauses.append(_schedule_clause(loop))
            if loop.parallel > 1:
                clauses.append(f"collapse({loop.parallel})")
        elif loop.simd:
            clauses.append("simd")
        if loop.simd and (not loop.parallel or loop.parallel == 1):
            clauses += [f"reduction({op}:{acc.name})" for op, acc in loop.reductions]
        return "#pragma omp " + " ".join(clauses) if clauses else ""

    def micro_kernel(self, call: ir.MicroKernelCall, scope: _Scope) -> None:
        k = call.kernel
        self.micro_kernels.setdefault(k.function, k.source())
        kc, accumulate = self.ref(call.kc, scope), self.ref(call.accumulate, scope)
        a, b, c = (self.ref(call.a_offset, scope), self.ref(call.b_offset, scope),
                   self.ref(call.c_offset, scope))
        scope.lines.append(f"{k.function}({kc}, {call.a} + {a}, {call.b} + {b}, {call.ldb}, "
                           f"{call.c} + {c}, {call.ldc}, {accumulate});")

    def branch(self, stmt: ir.If, scope: _Scope) -> None:
        cond = self.ref(stmt.cond, scope)
        then = _Scope(scope, set(), barrier=True)
        for s in stmt.body:
            self.statement(s, then)
        scope.lines.append(f"if ({cond}) {{")
        scope.lines.extend(_indent(then.lines))
        if stmt.orelse:
            other = _Scope(scope, set(), barrier=True)
            for s in stmt.orelse:
                self.statement(s, other)
            scope.lines.append("} else {")
            scope.lines.extend(_indent(other.lines))
        scope.lines.append("}")

    # --- expressions ---------------------------------------------------------------------------
    def ref(self, e: Expr, scope: _Scope) -> str:
        """A C expression for `e` at `scope`, defining temporaries where they belong."""
        if e.op == "const":
            return literal(e)
        if e.op in ("var", "local", "acc"):
            return e.name
        if self._state_read(e):
            return self._mutable_ref(e, scope)
        known = scope.lookup(e)
        if known is not None:
            return known
        target = self._placement(e, scope)
        text = self.render(e, [self.ref(a, target) for a in e.args])
        if e.op == "sum" and len(e.args) == 1 and e.attr[1] == 0:
            return text  # k*x: not worth a name
        name = self._temp()
        target.lines.append(f"const {C_TYPES[e.dtype]} {name} = {text};")
        target.names[e] = name
        return name

    def _mutable_ref(self, e: Expr, scope: _Scope) -> str:
        """Nodes reading mutable state: computed where used (never hoisted), shared by the
        statements of the same scope until the state they read is written."""
        if e in scope.mutable:
            return scope.mutable[e]
        text = self.render(e, [self.ref(a, scope) for a in e.args])
        if e.op in ("lload", "load"):
            return text
        name = self._temp()
        scope.lines.append(f"const {C_TYPES[e.dtype]} {name} = {text};")
        scope.mutable[e] = name
        return name

    def _temp(self) -> str:
        name = f"v{self.counter}"
        self.counter += 1
        return name

    def _state_read(self, e: Expr) -> frozenset[str]:
        """Names of the mutable state (accumulators, local arrays, buffers this stage writes)
        that `e` reads."""
        known = self.depends.get(e)
        if known is None:
            own = {e.name} if (e.op in ("acc", "lload")
                               or (e.op == "load" and e.name in self.written)) else set()
            known = frozenset(own).union(*(self._state_read(a) for a in e.args))
            self.depends[e] = known
        return known

    def _placement(self, e: Expr, scope: _Scope) -> _Scope:
        free = e.free
        while (scope.parent is not None and not scope.barrier
               and not (scope.defines & free)):
            scope = scope.parent
        return scope

    def render(self, e: Expr, a: list[str]) -> str:
        op, dtype = e.op, e.dtype
        t = C_TYPES[dtype]
        if op == "load":
            return f"{e.name}[{a[0]}]"
        if op == "lload":
            return f"{e.name}[{a[0]}]"
        if op == "sum":
            return _render_sum(e, a)
        if op == "fdiv":
            if e.args[0].range[0] >= 0:
                return f"({a[0]} / {e.attr})"
            self.helpers.add("fdiv")
            return f"kiln_fdiv({a[0]}, {e.attr})"
        if op == "fmod":
            if e.args[0].range[0] >= 0:
                return f"({a[0]} % {e.attr})"
            self.helpers.add("fmod")
            return f"kiln_fmod({a[0]}, {e.attr})"
        if op == "imul":
            return f"({a[0]} * {a[1]})"
        if op in COMPARISONS:
            return f"({a[0]} {COMPARISONS[op]} {a[1]})"
        if op == "and":
            return f"({a[0]} && {a[1]})"
        if op == "or":
            return f"({a[0]} || {a[1]})"
        if op == "xor":
            return f"({a[0]} != {a[1]})"
        if op == "not":
            return f"(!{a[0]})"
        if op == "select":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if op == "cast":
            return _render_cast(e.args[0].dtype, dtype, a[0])
        if op in ("add", "sub", "mul"):
            sym = {"add": "+", "sub": "-", "mul": "*"}[op]
            return _wrapping(dtype, f"{{0}} {sym} {{1}}", a)
        if op == "neg":
            if dtype in FLOAT_TYPES:
                return f"(-{a[0]})"
            return _wrapping(dtype, "{0} - {1}", ["0", a[0]])
        if op == "div":
            if dtype in FLOAT_TYPES:
                return f"({a[0]} / {a[1]})"
            self._int_helper("div", dtype)
            return f"kiln_div_{dtype}({a[0]}, {a[1]})"
        if op in ("mod_c", "mod_py"):
            if dtype in FLOAT_TYPES:
                fn = "fmodf" if dtype == "float32" else "fmod"
                if op == "mod_c":
                    return f"{fn}({a[0]}, {a[1]})"
                return (f"({fn}({a[0]}, {a[1]}) != 0 && (({fn}({a[0]}, {a[1]}) < 0) != ({a[1]} < 0))"
                        f" ? {fn}({a[0]}, {a[1]}) + {a[1]} : {fn}({a[0]}, {a[1]}))")
            name = "modc" if op == "mod_c" else "modpy"
            self._int_helper(name, dtype)
            return f"kiln_{name}_{dtype}({a[0]}, {a[1]})"
        if op in ("min", "max"):
            cmp = "<" if op == "min" else ">"
            if dtype in FLOAT_TYPES:
                return f"(({a[0]} {cmp} {a[1]} || {a[0]} != {a[0]}) ? {a[0]} : {a[1]})"
            return f"({a[0]} {cmp} {a[1]} ? {a[0]} : {a[1]})"
        if op == "abs":
            if dtype in FLOAT_TYPES:
                return f"{'fabsf' if dtype == 'float32' else 'fabs'}({a[0]})"
            if dtype.startswith("uint"):
                return a[0]
            return f"({a[0]} < 0 ? {_wrapping(dtype, '{0} - {1}', ['0', a[0]])} : {a[0]})"
        if op in ("bitand", "bitor", "bitxor"):
            sym = {"bitand": "&", "bitor": "|", "bitxor": "^"}[op]
            return f"(({t})({a[0]} {sym} {a[1]}))"
        if op == "bitnot":
            return f"(({t})(~{a[0]}))"
        if op in ("shl", "shr"):
            return _render_shift(op, dtype, a)
        if op == "bitcast":
            source = C_TYPES[e.args[0].dtype]
            return (f"({{ {t} bits_; const {source} from_ = {a[0]}; "
                    f"memcpy(&bits_, &from_, sizeof bits_); bits_; }})")
        if op == "call":
            own = cmath.function(e.attr, dtype)
            if own is not None:
                self.math.add(own)
                return f"{own}({', '.join(a)})"
            fn = e.attr + ("f" if dtype == "float32" else "")
            return f"{fn}({', '.join(a)})"
        raise ValueError(f"cannot render {op}")

    def _int_helper(self, name: str, dtype: str) -> None:
        if name == "modpy":
            self.helpers.add(f"modc_{dtype}")
        self.helpers.add(f"{name}_{dtype}")


CHUNKS_PER_LOOP = 32  # "chunked" loops: dynamic chunks of about 1/32 of the iterations


def _schedule_clause(loop: ir.Loop) -> str:
    """The OpenMP schedule of a parallel loop: "dynamic" hands out one iteration (a GEMM task) at
    a time; "chunked" (the memory-bound stages: elementwise, row, pack and depthwise loops)
    hands out chunks of about 1/CHUNKS_PER_LOOP of the (collapsed) iterations, so that a thread
    the OS deschedules on a loaded machine holds up only its chunk while the others take the
    rest; "static" splits the iterations evenly up front."""
    if loop.omp_schedule == "dynamic":
        return "schedule(dynamic, 1)"
    if loop.omp_schedule == "chunked":
        iterations, level = 1, loop
        for depth in range(max(loop.parallel, 1)):
            iterations *= level.static_extent or CHUNKS_PER_LOOP
            if depth + 1 < loop.parallel:
                level = level.body[0]
        return f"schedule(dynamic, {max(1, iterations // CHUNKS_PER_LOOP)})"
    return "schedule(static)"


def _writes(stmt: ir.Stmt) -> set[str]:
    """Names of the mutable state a statement (with its nested statements) writes."""
    names = set()
    for s in ir.iter_stmts([stmt]):
        if isinstance(s, (ir.Assign, ir.DeclAcc)):
            names.add(s.acc.name)
        elif isinstance(s, ir.ArrayStore):
            names.add(s.name)
        elif isinstance(s, ir.Store):
            names.add(s.buffer)
        elif isinstance(s, ir.MicroKernelCall):
            names.add(s.c)
    return names


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

