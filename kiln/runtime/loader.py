"""Running an artifact in-process: `kiln.load("model.kiln")` → a callable on numpy arrays.

    model = kiln.load("model.kiln")
    outputs = model(input_ids=ids, attention_mask=mask)   # or model(ids, mask)
    outputs["last_hidden_state"]                          # a dict: output name -> array

Inputs are given by the model's input names (keywords) or in the model's order (positional);
each must have exactly the dtype and shape the artifact was compiled for. The outputs dict is
in the model's output order; its arrays are fresh on every call. `model.run(...)` takes the same
arguments and returns the outputs as a list in the model's order. Calls on one model are
serialised (it owns one arena); each call is a single native call into the library.
"""
from __future__ import annotations

import ctypes
import platform
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.runtime.artifact import Artifact, ArtifactError, TensorInfo, open_artifact
from kiln.target import host_target

ERROR_BYTES = 1024


class CompiledModel:
    def __init__(self, artifact: Artifact, threads: int | None = None):
        check_runs_here(artifact)
        self.artifact = artifact
        self.inputs: tuple[TensorInfo, ...] = artifact.inputs
        self.outputs: tuple[TensorInfo, ...] = artifact.outputs
        self._lib = _bind(_load_library(artifact.library))
        error = ctypes.create_string_buffer(ERROR_BYTES)
        handle = self._lib.kiln_model_create(str(artifact.weights).encode(), error, ERROR_BYTES)
        if not handle:
            raise ArtifactError(f"cannot create the model: {error.value.decode(errors='replace')}")
        self._handle = ctypes.c_void_p(handle)
        self._finalizer = weakref.finalize(self, self._lib.kiln_model_destroy, self._handle)
        self._lock = threading.Lock()
        if threads is not None:
            self.set_threads(threads)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def threads(self) -> int:
        return self._lib.kiln_model_threads(self._handle)

    def set_threads(self, threads: int) -> None:
        """Threads per call; 0 restores $KILN_NUM_THREADS, else $OMP_NUM_THREADS, else the
        CPUs this process may run on."""
        if threads < 0:
            raise KilnError(f"threads must be >= 0, got {threads}")
        self._lib.kiln_model_set_threads(self._handle, threads)

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        """Outputs by name (see the module's docstring)."""
        return dict(zip(self.output_names, self.run(*args, **kwargs)))

    def run(self, *args: Any, **kwargs: Any) -> list[np.ndarray]:
        """Outputs in the model's order (also when two outputs share a name)."""
        feeds = self._arrays(bind_inputs(self.inputs, args, kwargs))
        outputs = [np.empty(t.shape, dtype=t.dtype) for t in self.outputs]
        in_ptrs = _pointers(feeds)
        out_ptrs = _pointers(outputs)
        with self._lock:
            status = self._lib.kiln_model_run(self._handle, in_ptrs, out_ptrs)
        if status != 0:
            raise KilnError(f"the model failed (status {status})")
        return outputs

    def _arrays(self, values: Sequence[Any]) -> list[np.ndarray]:
        return [check_input(info, value) for info, value in zip(self.inputs, values)]

    def close(self) -> None:
        self._finalizer()


def load(path: str | Path, threads: int | None = None) -> CompiledModel:
    """Load an artifact built for this machine; `threads` per call (default: see set_threads)."""
    return CompiledModel(open_artifact(path), threads)


def check_runs_here(artifact: Artifact) -> None:
    machine = platform.machine()
    if artifact.arch != machine:
        raise ArtifactError(
            f"this artifact was built for {artifact.arch} and cannot run in-process on this "
            f"{machine} machine; run it with its runner on an {artifact.arch} device, or here "
            f"under qemu with `kiln run` / `kiln verify` / `kiln bench`, which use qemu-"
            f"{artifact.arch} automatically")
    missing = sorted(set(artifact.isa) - set(host_target().isa) - {"neon"})
    if missing:
        raise ArtifactError(f"this artifact uses CPU features this machine lacks: "
                            f"{', '.join(missing)}; compile it with --target host")


def bind_inputs(inputs: Sequence[TensorInfo], args: Sequence[Any],
                kwargs: Mapping[str, Any]) -> list[Any]:
    """The inputs in the model's order, from positional and keyword arguments, or from one
    mapping of input names to arrays (what onnxruntime's `run` takes)."""
    names = [t.name for t in inputs]
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        args, kwargs = (), args[0]
    if len(args) > len(names):
        raise KilnError(f"the model takes {len(names)} input(s) ({', '.join(names)}), "
                        f"but {len(args)} were given")
    values = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names:
            raise KilnError(f"unknown input {name!r}; the model's inputs are {', '.join(names)}")
        if name in values:
            raise KilnError(f"input {name!r} was given twice (by position and by name)")
        values[name] = value
    missing = [n for n in names if n not in values]
    if missing:
        raise KilnError(f"missing input(s) {', '.join(missing)}; expected "
                        + ", ".join(f"{t.name}: {t.describe()}" for t in inputs if t.name in missing))
    return [values[n] for n in names]


def check_input(info: TensorInfo, value: Any) -> np.ndarray:
    """`value` as a C-contiguous array, if it has exactly the dtype and shape of `info`."""
    array = np.asarray(value)
    if array.dtype != np.dtype(info.dtype) or array.shape != info.shape:
        raise KilnError(f"input {info.name!r} must be {info.describe()}, got "
                        f"{array.dtype.name} {list(array.shape)}")
    return np.ascontiguousarray(array)


def _load_library(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))


def _pointers(arrays: Sequence[np.ndarray]) -> ctypes.Array:
    return (ctypes.c_void_p * max(len(arrays), 1))(*(a.ctypes.data for a in arrays))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.kiln_model_create.restype = ctypes.c_void_p
    lib.kiln_model_create.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.kiln_model_run.restype = ctypes.c_int
    lib.kiln_model_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.kiln_model_set_threads.restype = None
    lib.kiln_model_set_threads.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.kiln_model_threads.restype = ctypes.c_int
    lib.kiln_model_threads.argtypes = [ctypes.c_void_p]
    lib.kiln_model_destroy.restype = None
    lib.kiln_model_destroy.argtypes = [ctypes.c_void_p]
    return lib
