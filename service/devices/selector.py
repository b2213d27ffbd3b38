"""The one device selector grammar: comma-separated `key:value` terms (Qualcomm AI Hub's style).

    kind:phone,arch:aarch64,feature:neon,name:pixel

Every term must hold (terms are ANDed; `feature` may repeat). Used by `GET /v1/devices?device=`,
profile job bodies, `kiln profile --device` and the dashboard's filter. Matching is done on the
device's stored facts, so it works the same on SQLite and PostgreSQL.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_SELECTOR_CHARS = 1000
MAX_TERMS = 32


def _contains(text: Any, value: str) -> bool:
    return value.lower() in str(text or "").lower()


def _facts(device: Any) -> Mapping[str, Any]:
    return device.facts or {}


# key -> (what it matches, predicate(device, value)). Substring matches ignore case.
TERMS: dict[str, tuple[str, Callable[[Any, str], bool]]] = {
    "kind": ("device kind, exactly: cpu, phone or gpu-host (gpu means gpu-host)",
             lambda d, v: d.kind == ("gpu-host" if v == "gpu" else v)),
    "arch": ("architecture, exactly: x86_64, aarch64, …", lambda d, v: d.arch == v),
    "feature": ("an ISA feature the device has: neon, avx2, dotprod, …",
                lambda d, v: v in (_facts(d).get("isa") or ())),
    "name": ("part of the device's name", lambda d, v: _contains(d.name, v)),
    "id": ("the device id, exactly", lambda d, v: d.id == v),
    "model": ("part of the phone model or CPU model",
              lambda d, v: _contains(_facts(d).get("device_model"), v)
              or _contains(_facts(d).get("cpu_model"), v)),
    "gpu": ("part of the GPU model", lambda d, v: _contains(_facts(d).get("gpu_model"), v)),
    "os": ("part of the OS description (Android 14, Linux 6…)",
           lambda d, v: _contains(_facts(d).get("os"), v)),
    "cores": ("at least this many logical cores",
              lambda d, v: int(_facts(d).get("logical_cores") or 0) >= int(v)),
    "status": ("online, busy or offline", lambda d, v: d.status == v),
    "transport": ("local, ssh, adb or worker", lambda d, v: d.transport == v),
    "fingerprint": ("the start of the device class fingerprint",
                    lambda d, v: d.fingerprint.startswith(v.lower())),
}


class SelectorError(ValueError):
    """A selector that does not parse; the message names the bad term."""


@dataclass(frozen=True)
class Selector:
    terms: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __str__(self) -> str:
        return ",".join(f"{k}:{v}" for k, v in self.terms)

    def matches(self, device: Any) -> bool:
        return all(TERMS[key][1](device, value) for key, value in self.terms)

    def and_also(self, other: "Selector") -> "Selector":
        return Selector(self.terms + other.terms)


def parse(text: str | None) -> Selector:
    """`kind:phone,arch:aarch64` -> Selector; SelectorError for anything else."""
    text = (text or "").strip()
    if not text:
        return Selector()
    if len(text) > MAX_SELECTOR_CHARS:
        raise SelectorError(f"a device selector has at most {MAX_SELECTOR_CHARS} characters")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > MAX_TERMS:
        raise SelectorError(f"a device selector has at most {MAX_TERMS} terms")
    terms = []
    for part in parts:
        key, sep, value = part.partition(":")
        key, value = key.strip().lower(), value.strip()
        if not sep or not key or not value:
            raise SelectorError(f"device selector term {part!r} is not key:value "
                                f"(e.g. kind:phone,arch:aarch64)")
        if key not in TERMS:
            raise SelectorError(f"unknown device selector key {key!r}; known keys: "
                                f"{', '.join(TERMS)}")
        if key == "cores" and not value.isdigit():
            raise SelectorError(f"cores:{value}: give a whole number of cores")
        if key == "kind" and value not in ("cpu", "phone", "gpu-host", "gpu"):
            raise SelectorError(f"kind:{value}: the kinds are cpu, phone and gpu-host")
        terms.append((key, value))
    return Selector(tuple(terms))


def from_params(**params: str | list[str] | None) -> Selector:
    """A selector from query parameters named like its keys (`?kind=phone&feature=neon`)."""
    terms: list[str] = []
    for key, value in params.items():
        values = value if isinstance(value, list) else [value]
        terms += [f"{key}:{v}" for v in values if v]
    return parse(",".join(terms))


def grammar_help() -> str:
    return "; ".join(f"{key}:… {what}" for key, (what, _) in TERMS.items())
