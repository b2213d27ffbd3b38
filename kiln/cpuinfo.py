"""/proc/cpuinfo and sysfs cache sizes: the one parser of each, for this machine (kiln.target,
kiln.profile.machine) and for the devices a device agent reads them from.

Both layouts are understood: x86 (`model name`, `flags`) and Arm (`Features`, `CPU implementer`
and `CPU part`, which name the cores, and on older kernels a `Hardware` line).
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

TEXT_LIMIT = 256  # longest text fact kept

# x86 /proc/cpuinfo flag -> recorded ISA feature (the names Kiln's targets use).
X86_ISA = {
    "sse2": "sse2", "pni": "sse3", "ssse3": "ssse3", "sse4_1": "sse4_1", "sse4_2": "sse4_2",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f",
    "avx512dq": "avx512dq", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16",
    "avx512_fp16": "avx512_fp16", "avx_vnni": "avx_vnni", "amx_tile": "amx_tile",
    "amx_bf16": "amx_bf16", "amx_int8": "amx_int8",
}
# Arm `Features` -> recorded ISA feature.
ARM_ISA = {
    "asimd": "neon", "neon": "neon", "fp": "fp", "asimdhp": "fp16", "asimddp": "dotprod",
    "i8mm": "i8mm", "bf16": "bf16", "sve": "sve", "sve2": "sve2", "sme": "sme",
    "atomics": "atomics", "crc32": "crc32", "aes": "aes", "sha2": "sha2", "vfpv4": "vfpv4",
}
ARM_IMPLEMENTERS = {0x41: "ARM", 0x42: "Broadcom", 0x48: "HiSilicon", 0x4E: "NVIDIA",
                    0x51: "Qualcomm", 0x53: "Samsung", 0x61: "Apple", 0xC0: "Ampere"}
ARM_PARTS = {  # (implementer, part) -> core name
    (0x41, 0xD03): "Cortex-A53", (0x41, 0xD04): "Cortex-A35", (0x41, 0xD05): "Cortex-A55",
    (0x41, 0xD07): "Cortex-A57", (0x41, 0xD08): "Cortex-A72", (0x41, 0xD09): "Cortex-A73",
    (0x41, 0xD0A): "Cortex-A75", (0x41, 0xD0B): "Cortex-A76", (0x41, 0xD0C): "Neoverse-N1",
    (0x41, 0xD0D): "Cortex-A77", (0x41, 0xD40): "Neoverse-V1", (0x41, 0xD41): "Cortex-A78",
    (0x41, 0xD44): "Cortex-X1", (0x41, 0xD46): "Cortex-A510", (0x41, 0xD47): "Cortex-A710",
    (0x41, 0xD48): "Cortex-X2", (0x41, 0xD49): "Neoverse-N2", (0x41, 0xD4D): "Cortex-A715",
    (0x41, 0xD4E): "Cortex-X3", (0x41, 0xD4F): "Neoverse-V2", (0x41, 0xD80): "Cortex-A520",
    (0x41, 0xD81): "Cortex-A720", (0x41, 0xD82): "Cortex-X4",
}
ARCH_ALIASES = {"arm64": "aarch64", "armv8l": "aarch64", "amd64": "x86_64"}


def clean_text(text: str | None, limit: int = TEXT_LIMIT) -> str:
    """One line of printable text, whitespace collapsed, at most `limit` characters."""
    if not text:
        return ""
    printable = "".join(c if c.isprintable() else " " for c in text)
    return " ".join(printable.split())[:limit]


def key_value_blocks(text: str) -> list[dict[str, str]]:
    """`key : value` blocks separated by blank lines (the /proc/cpuinfo layout)."""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition(":")
        if sep:
            current.setdefault(key.strip().lower(), value.strip())
    if current:
        blocks.append(current)
    return blocks


def parse_int(text: str | None, base: int = 10) -> int | None:
    try:
        return int(text.strip(), base) if text is not None else None
    except ValueError:
        return None


def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo of x86 or Arm Linux: cpu_vendor, cpu_model, logical_cores, core_types, flags.

    `flags` holds the raw feature names (x86 `flags`, Arm `Features`) of the first processor;
    `isa_features` maps them to ISA features. Arm cores are named from (implementer, part); the
    model is the `model name` (x86), else the `Hardware` line (older Arm kernels), else the core
    types, e.g. "4x Cortex-A55 + 2x Cortex-A78 + 2x Cortex-X1".
    """
    blocks = key_value_blocks(text)
    processors = [b for b in blocks if "processor" in b and parse_int(b["processor"]) is not None]
    extra: dict[str, str] = {}
    for b in blocks:
        if b not in processors:
            extra.update(b)
    first = processors[0] if processors else (blocks[0] if blocks else {})
    flags = (first.get("flags") or first.get("features") or "").split()
    vendor, model = first.get("vendor_id", ""), first.get("model name", "")
    core_types: Counter[str] = Counter()
    if "cpu implementer" in first:
        for b in processors:
            implementer = parse_int(b.get("cpu implementer"), 16)
            part = parse_int(b.get("cpu part"), 16)
            if implementer is None or part is None:
                continue
            name = ARM_PARTS.get((implementer, part))
            if name is None:
                name = f"{ARM_IMPLEMENTERS.get(implementer, hex(implementer))} part {part:#x}"
            core_types[name] += 1
        implementers = {parse_int(b.get("cpu implementer"), 16) for b in processors}
        vendor = vendor or "/".join(ARM_IMPLEMENTERS.get(i, hex(i)) for i in sorted(
            i for i in implementers if i is not None))
    hardware = extra.get("hardware") or first.get("hardware", "")
    if not model and hardware:
        model = hardware
    if not model and core_types:
        model = describe_core_types(core_types)
    return {"cpu_vendor": clean_text(vendor), "cpu_model": clean_text(model),
            "logical_cores": len(processors), "core_types": dict(core_types),
            "flags": flags, "isa_features": isa_features(flags)}


def describe_core_types(core_types: Mapping[str, int]) -> str:
    """"4x Cortex-A55 + 2x Cortex-A78 + …" in /proc/cpuinfo's order of appearance."""
    return " + ".join(f"{n}x {name}" for name, n in core_types.items())


def isa_features(flags: Iterable[str], arch: str = "") -> tuple[str, ...]:
    """Recorded ISA features of raw x86 flags or Arm features (`neon` on every aarch64 CPU)."""
    found = {X86_ISA.get(f) or ARM_ISA.get(f) for f in flags} - {None}
    if normalize_arch(arch) == "aarch64":
        found.add("neon")  # Advanced SIMD is mandatory on aarch64
    return tuple(sorted(found))  # type: ignore[arg-type]


def normalize_arch(machine: str) -> str:
    machine = machine.strip()
    return ARCH_ALIASES.get(machine, machine)


def parse_size(text: str | None) -> int | None:
    """A sysfs cache size ("48K", "1024K", "32M") in bytes."""
    if not text:
        return None
    match = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not match:
        return None
    return int(match.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[
        match.group(2).upper()]


def parse_caches(entries: Iterable[tuple[str | None, str | None, str | None]]) -> dict:
    """cpu0's sysfs cache entries (level, type, size texts) -> l1d/l1i/l2/l3 sizes in bytes."""
    sizes: dict[str, int] = {}
    for level, kind, size in entries:
        lvl, parsed, kind = parse_int(level), parse_size(size), (kind or "").strip()
        if lvl is None or parsed is None:
            continue
        if lvl == 1 and kind == "Instruction":
            sizes["l1i_bytes"] = parsed
        elif lvl == 1 and kind in ("Data", "Unified"):
            sizes["l1d_bytes"] = parsed
        elif lvl in (2, 3) and kind != "Instruction":
            sizes[f"l{lvl}_bytes"] = parsed
    return sizes


def host_cpuinfo() -> dict:
    """`parse_cpuinfo` of this machine's /proc/cpuinfo (empty facts where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    return parse_cpuinfo(text)


def host_caches() -> dict:
    """`parse_caches` of this machine's cpu0 (sizes that cannot be read are left out)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        entries = sorted(base.glob("index*"))
    except OSError:
        entries = []
    return parse_caches(tuple(_read(entry / name) for name in ("level", "type", "size"))
                        for entry in entries)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None
