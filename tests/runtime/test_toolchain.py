"""The toolchain: objects cached by content hash, clear errors from the compiler."""
from __future__ import annotations

import ctypes
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.codegen import Kernel
from kiln.runtime.artifact import build_artifact
from kiln.errors import KilnError
from kiln.runtime import toolchain
from kiln.runtime.toolchain import (
    BUILD_TIMEOUT_ENV,
    BuildCache,
    ToolchainError,
    build_timeout,
    compiler_for,
    link_shared,
)
from kiln.target import Target, target
from tests.runtime.handmade import chain, mlp


def test_a_second_build_compiles_nothing(tmp_path):
    model = mlp()
    cache = BuildCache(tmp_path / "cache")
    build_artifact(model.plan, model.kernels, target("host"), {}, tmp_path / "a.kiln", cache)
    assert (cache.compiled, cache.reused) == (5, 0)  # 3 kernels, the driver, the runner
    objects = sorted((tmp_path / "cache").rglob("*.o"))
    build_artifact(model.plan, model.kernels, target("host"), {}, tmp_path / "b.kiln", cache)
    assert (cache.compiled, cache.reused) == (5, 5)
    assert sorted((tmp_path / "cache").rglob("*.o")) == objects
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_kernels_with_equal_bodies_are_compiled_once(tmp_path):
    model = chain(6)
    cache = BuildCache(tmp_path / "cache")
    report = build_artifact(model.plan, model.kernels, target("host"), {}, tmp_path / "c.kiln",
                            cache)
    assert report["compiled_kernels"] == 6
    assert report["distinct_kernels"] == 1
    assert cache.compiled == 3  # one kernel body, the driver, the runner


def test_the_cache_key_covers_source_flags_and_compiler():
    compiler = compiler_for(target("host"))
    assert compiler.key("int a;") == compiler.key("int a;")
    assert compiler.key("int a;") != compiler.key("int b;")
    assert replace(compiler, flags=("-O2",)).key("int a;") != compiler.key("int a;")
    assert replace(compiler, version="gcc 1.0").key("int a;") != compiler.key("int a;")


def test_a_compile_error_names_the_kernel_and_quotes_the_compiler(tmp_path):
    model = chain(2)
    broken = Kernel("k1_relu", "b1", "void k1_relu(void *const *args) { return 1 +; }",
                    model.kernels[1].args, model.kernels[1].outputs)
    out = tmp_path / "out" / "broken.kiln"
    with pytest.raises(ToolchainError) as caught:
        build_artifact(model.plan, [model.kernels[0], broken], target("host"), {}, out,
                       BuildCache(tmp_path / "cache"))
    message = str(caught.value)
    assert "compiling kernel k1_relu failed" in message
    assert "error:" in message
    assert not out.exists()
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_missing_cross_compiler_says_what_to_install():
    fake = Target("aarch64", "aarch64", ("neon",), "kiln-test-no-such-gcc", ())
    with pytest.raises(ToolchainError, match="apt-get install gcc-aarch64-linux-gnu"):
        compiler_for(fake)


def test_a_compiler_for_another_architecture_is_refused():
    wrong = Target("aarch64", "aarch64", ("neon",), target("x86_64").cc, ())
    if compiler_for(target("x86_64")).arch != "x86_64":
        pytest.skip("the host compiler does not build for x86_64")
    with pytest.raises(ToolchainError, match="not for aarch64"):
        compiler_for(wrong)


def _slow_kernel(symbol: str, statements: int) -> str:
    """A valid kernel gcc -O3 needs minutes for: one long dependent chain of float updates."""
    lines = [f"void {symbol}(void *const *args) {{",
             "  const float *x = (const float *)args[0]; float *y = (float *)args[1];",
             "  float a = x[0], b = x[1];"]
    lines += [f"  a = a * x[{i % 13}] + b; b = b * x[{i * 7 % 11}] - a;" for i in range(statements)]
    return "\n".join([*lines, "  y[0] = a + b;", "}"])


def _processes_reading(path_part: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and path_part in (entry / "cmdline").read_bytes().decode(
                    errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_compile_past_the_build_deadline_is_stopped_and_named(tmp_path):
    model = chain(2)
    slow = Kernel("k1_relu", "b1", _slow_kernel("k1_relu", 20000), model.kernels[1].args,
                  model.kernels[1].outputs)
    out = tmp_path / "slow.kiln"
    cache = tmp_path / "cache"
    started = time.monotonic()
    with pytest.raises(ToolchainError) as caught:
        build_artifact(model.plan, [model.kernels[0], slow], target("host"), {}, out,
                       BuildCache(cache), timeout=2.0)
    assert time.monotonic() - started < 30
    assert "compiling kernel k1_relu: still running at the build's deadline" in str(caught.value)
    assert not out.exists() and not list(tmp_path.rglob("*.tmp"))
    time.sleep(0.5)
    assert _processes_reading(str(cache)) == []  # gcc's cc1 was killed with gcc


def test_the_default_build_deadline_grows_with_the_sources(monkeypatch):
    monkeypatch.delenv(BUILD_TIMEOUT_ENV, raising=False)
    assert build_timeout(10 << 20) > build_timeout(10 << 10) >= 60
    monkeypatch.setenv(BUILD_TIMEOUT_ENV, "7.5")
    assert build_timeout(10 << 20) == 7.5
    monkeypatch.setenv(BUILD_TIMEOUT_ENV, "-1")
    with pytest.raises(KilnError, match=BUILD_TIMEOUT_ENV):
        build_timeout(1)


def _kernel_source(function: str, value: int, helper: str = "") -> str:
    """A kernel writing `value`, through a guarded noinline helper named `helper` if given (as
    generated kernels call their micro-kernels)."""
    if not helper:
        return f"void {function}(void *const *args) {{ *(int *)args[0] = {value}; }}\n"
    return (f"#ifndef KILN_HELPER_{helper.upper()}\n#define KILN_HELPER_{helper.upper()}\n"
            f"static __attribute__((noinline)) int {helper}(int v) {{ return v; }}\n#endif\n"
            f"void {function}(void *const *args) {{ *(int *)args[0] = {helper}({value}); }}\n")


def _record_compiles(monkeypatch) -> list[str]:
    """The source of each translation unit the toolchain compiles from now on."""
    units: list[str] = []
    real = toolchain.run_tool

    def recording(argv, what, deadline=None):
        if "-c" in argv:
            units.append(Path(argv[argv.index("-c") + 1]).read_text())
        return real(argv, what, deadline)

    monkeypatch.setattr(toolchain, "run_tool", recording)
    return units


def test_kernels_compiled_together_are_cached_and_linked_one_by_one(tmp_path, monkeypatch):
    compiler = compiler_for(target("host"))
    if toolchain.relocatable_linker(compiler.command) is None:
        pytest.skip("the host compiler has no linker to cut objects with")
    compiles = _record_compiles(monkeypatch)
    cache = BuildCache(tmp_path / "cache")
    functions = {f"kernel k{i}": f"kiln_k_{i}" for i in range(4)}
    sources = {name: _kernel_source(f, i + 10) for i, (name, f) in enumerate(functions.items())}
    first = cache.objects(compiler, {n: sources[n] for n in list(sources)[:3]}, kernels=functions)
    assert (cache.compiled, len(compiles)) == (3, 1)  # three kernels, one compiler process
    second = cache.objects(compiler, {n: sources[n] for n in list(sources)[1:]}, kernels=functions)
    assert (cache.compiled, cache.reused) == (4, 2)
    objects = {**first, **second}
    # each kernel's object defines its function alone: a build linking objects cut from two
    # batches gets every function once
    library = tmp_path / "kernels.so"
    link_shared(compiler, list(objects.values()), library)
    loaded = ctypes.CDLL(str(library))
    for i, (name, function) in enumerate(functions.items()):
        out = ctypes.c_int(0)
        getattr(loaded, function)((ctypes.c_void_p * 1)(ctypes.addressof(out)))
        assert out.value == i + 10, name
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    assert not list((tmp_path / "cache").glob(".batch-*"))


def test_a_kernel_with_a_noinline_helper_is_compiled_alone(tmp_path, monkeypatch):
    """GCC specialises a non-inlined static helper for its callers' constant arguments; alone,
    the kernel gets the code it gets in any build."""
    compiler = compiler_for(target("host"))
    compiles = _record_compiles(monkeypatch)
    functions = {f"kernel k{i}": f"kiln_k_{i}" for i in range(4)}
    sources = {name: _kernel_source(f, i + 20, helper="kiln_ukr_test" if i < 2 else "")
               for i, (name, f) in enumerate(functions.items())}
    objects = BuildCache(tmp_path / "cache").objects(compiler, sources, kernels=functions)
    assert sorted(unit.count("kiln_k_") for unit in compiles) == [1, 1, 2]
    assert all(unit.count("noinline") <= 1 for unit in compiles)
    library = tmp_path / "kernels.so"
    link_shared(compiler, list(objects.values()), library)
    loaded = ctypes.CDLL(str(library))
    for i, function in enumerate(functions.values()):
        out = ctypes.c_int(0)
        getattr(loaded, function)((ctypes.c_void_p * 1)(ctypes.addressof(out)))
        assert out.value == i + 20, function
