"""Hardware facts read from a device itself, and the fingerprint that groups identical hardware.

The agent never trusts its own configuration for what a device is: it runs two small probes on
the device (`PROBE` and `file_probe`) through the device's backend and parses what they print —
/proc/cpuinfo (x86 and Arm formats), `uname`, sysfs cpufreq and cache files, `getprop` (Android),
`nvidia-smi` (CSV query and banner) and `clinfo` — into a `HardwareFacts`. Each parser is a pure
function of the text, so tests feed them captured outputs.

Two fingerprints:

- `cpu_fingerprint` is `kiln.profile.machine.static_fingerprint` of the CPU facts (model, logical
  cores, ISA features Kiln records, L1d/L2/L3 sizes, architecture). For this machine it equals
  `kiln.profile.machine.host_machine().fingerprint`, the key Kiln's own SQLite profile store files
  CPU kernel latencies under, so measurements an agent takes on identical CPUs land on the same key.
- `fingerprint` (sha256 hex) adds the rest of the identity: device kind, Arm core types, every
  recorded ISA feature, the phone model, the GPU model, count, memory and compute capability, and
  whether the device is emulated. Frequencies (governors, thermal caps, kernel tables), OS versions
  and builds, driver, CUDA and OpenCL versions are recorded but left out: the same hardware keeps
  its fingerprint across governors and OS updates.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    computed_field,
    field_validator,
)

from kiln.profile.machine import ISA_FEATURES, static_fingerprint

FACTS_VERSION = 1
DeviceKind = Literal["cpu", "phone", "gpu-host"]
Transport = Literal["local", "ssh", "adb"]
TEXT_LIMIT = 256  # longest text fact kept
MAX_CPUS = 1024

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
ABI_ARCH = {"arm64-v8a": "aarch64", "armeabi-v7a": "armv7l", "x86_64": "x86_64", "x86": "i686"}


class FactsError(ValueError):
    """A device's probe output cannot be turned into hardware facts."""


class HardwareFacts(BaseModel):
    """What a device is, as read from the device. Sizes in bytes, frequencies in kHz."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    kind: DeviceKind
    arch: str = Field(max_length=32)  # x86_64, aarch64, armv7l
    abi: str = Field(max_length=32)  # arm64-v8a on Android; else the architecture
    os: str = Field(max_length=TEXT_LIMIT)  # "Linux 6.1.0-18-amd64", "Android 14 (API 34)"
    os_build: str = Field("", max_length=TEXT_LIMIT)  # uname -a without host name; build fingerprint
    device_model: str = Field("", max_length=TEXT_LIMIT)  # "Google Pixel 7"; empty for hosts
    cpu_vendor: str = Field("", max_length=TEXT_LIMIT)
    cpu_model: str = Field(max_length=TEXT_LIMIT)
    core_types: dict[Annotated[str, StringConstraints(max_length=64)], Annotated[
        int, Field(ge=1, le=MAX_CPUS)]] = Field(default_factory=dict, max_length=64)  # "Cortex-A55": 4
    logical_cores: int = Field(ge=1, le=MAX_CPUS)
    min_freq_khz: int | None = Field(None, ge=0)
    max_freq_khz: int | None = Field(None, ge=0)
    l1d_bytes: int | None = Field(None, ge=0)
    l1i_bytes: int | None = Field(None, ge=0)
    l2_bytes: int | None = Field(None, ge=0)
    l3_bytes: int | None = Field(None, ge=0)
    isa: tuple[Annotated[str, StringConstraints(max_length=32)], ...] = Field(
        (), max_length=128)  # sorted; names from X86_ISA / ARM_ISA values
    gpu_model: str | None = Field(None, max_length=TEXT_LIMIT)
    gpu_count: int = Field(0, ge=0, le=64)
    gpu_memory_mib: int | None = Field(None, ge=0)
    gpu_driver: str | None = Field(None, max_length=64)
    gpu_compute_capability: str | None = Field(None, max_length=16)
    cuda_version: str | None = Field(None, max_length=32)
    opencl_version: str | None = Field(None, max_length=TEXT_LIMIT)
    opencl_device: str | None = Field(None, max_length=TEXT_LIMIT)
    emulated: bool = False  # an emulator (ro.kernel.qemu): timings are not the hardware's

    @field_validator("isa")
    @classmethod
    def _sorted_isa(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(value)))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cpu_fingerprint(self) -> str:
        """kiln.profile.machine's fingerprint of the CPU facts (Kiln's profile key for a CPU)."""
        isa = tuple(sorted(f for f in self.isa if f in ISA_FEATURES))
        return static_fingerprint(self.cpu_model, self.logical_cores, isa, self.l1d_bytes,
                                  self.l2_bytes, self.l3_bytes, self.arch)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fingerprint(self) -> str:
        """sha256 hex of the identity-defining facts (see the module docstring)."""
        identity = {
            "version": FACTS_VERSION, "kind": self.kind, "cpu": self.cpu_fingerprint,
            "core_types": dict(sorted(self.core_types.items())), "isa": list(self.isa),
            "l1i": self.l1i_bytes, "device_model": self.device_model,
            "gpu": [self.gpu_model, self.gpu_count, self.gpu_memory_mib,
                    self.gpu_compute_capability],
            "emulated": self.emulated,
        }
        text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Parsers: text -> dict of facts

def _clean(text: str | None, limit: int = TEXT_LIMIT) -> str:
    """One line of printable text, whitespace collapsed, at most `limit` characters."""
    if not text:
        return ""
    printable = "".join(c if c.isprintable() else " " for c in text)
    return " ".join(printable.split())[:limit]


def _blocks(text: str) -> list[dict[str, str]]:
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


def _int(text: str | None, base: int = 10) -> int | None:
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
    blocks = _blocks(text)
    processors = [b for b in blocks if "processor" in b and _int(b["processor"]) is not None]
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
            implementer, part = _int(b.get("cpu implementer"), 16), _int(b.get("cpu part"), 16)
            if implementer is None or part is None:
                continue
            name = ARM_PARTS.get((implementer, part))
            if name is None:
                name = f"{ARM_IMPLEMENTERS.get(implementer, hex(implementer))} part {part:#x}"
            core_types[name] += 1
        implementers = {_int(b.get("cpu implementer"), 16) for b in processors}
        vendor = vendor or "/".join(ARM_IMPLEMENTERS.get(i, hex(i)) for i in sorted(
            i for i in implementers if i is not None))
    hardware = extra.get("hardware") or first.get("hardware", "")
    if not model and hardware:
        model = hardware
    if not model and core_types:
        model = describe_core_types(core_types)
    return {"cpu_vendor": _clean(vendor), "cpu_model": _clean(model),
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


def parse_uname(text: str) -> dict:
    """`uname -a`: system, release, machine, and the line without the host name (`build`)."""
    parts = text.strip().split()
    if len(parts) < 3:
        return {"system": _clean(parts[0]) if parts else "", "release": "", "machine": "",
                "build": _clean(text)}
    machine = ""
    for token in reversed(parts[3:]):
        if re.fullmatch(r"x86_64|amd64|i[3-6]86|aarch64|arm64|armv\d+\w*|riscv\d+|ppc64\w*|s390x",
                        token):
            machine = normalize_arch(token)
            break
    return {"system": _clean(parts[0]), "release": _clean(parts[2]), "machine": machine,
            "build": _clean(" ".join([parts[0], *parts[2:]]))}


def parse_getprop(text: str) -> dict[str, str]:
    """Android `getprop` output (`[key]: [value]` lines) as a dict."""
    props = {}
    for match in re.finditer(r"^\[([^\]\n]+)\]: \[([^\n]*)\]\s*$", text, re.MULTILINE):
        props[match.group(1)] = match.group(2)
    return props


def parse_possible(text: str) -> list[int]:
    """/sys/devices/system/cpu/possible ("0-7", "0,2-3") as CPU numbers (at most MAX_CPUS)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.strip().partition("-")
        a, b = _int(lo), _int(hi) if hi else _int(lo)
        if a is None or b is None or a > b:
            continue
        cpus.extend(range(a, min(b, a + MAX_CPUS - 1) + 1))
    return sorted(set(cpus))[:MAX_CPUS]


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
        lvl, parsed, kind = _int(level), parse_size(size), (kind or "").strip()
        if lvl is None or parsed is None:
            continue
        if lvl == 1 and kind == "Instruction":
            sizes["l1i_bytes"] = parsed
        elif lvl == 1 and kind in ("Data", "Unified"):
            sizes["l1d_bytes"] = parsed
        elif lvl in (2, 3) and kind != "Instruction":
            sizes[f"l{lvl}_bytes"] = parsed
    return sizes


def parse_cpufreq(files: Mapping[str, str]) -> dict:
    """cpuinfo_min_freq / cpuinfo_max_freq files (path -> text, kHz) -> the overall range.

    The hardware limits (`cpuinfo_*`), not the governor's current `scaling_*` limits.
    """
    mins = [v for p, t in files.items() if p.endswith("cpuinfo_min_freq") and (v := _int(t))]
    maxs = [v for p, t in files.items() if p.endswith("cpuinfo_max_freq") and (v := _int(t))]
    return {"min_freq_khz": min(mins) if mins else None, "max_freq_khz": max(maxs) if maxs else None}


def parse_nvidia_smi_csv(text: str) -> dict:
    """`nvidia-smi --query-gpu=name,memory.total,driver_version[,compute_cap] --format=csv`."""
    rows = [r for r in csv.reader(io.StringIO(text.strip()), skipinitialspace=True) if r]
    if len(rows) < 2:
        return {}
    header = [re.sub(r"\s*\[.*\]$", "", h.strip()).lower() for h in rows[0]]
    gpus = [dict(zip(header, (c.strip() for c in row))) for row in rows[1:]
            if len(row) == len(header)]
    gpus = [g for g in gpus if g.get("name") and not g["name"].startswith("[")]
    if not gpus:
        return {}
    first = gpus[0]
    names = list(dict.fromkeys(g["name"] for g in gpus))
    memory = re.match(r"(\d+)", first.get("memory.total", ""))
    cc = first.get("compute_cap", "")
    return {
        "gpu_model": _clean(" + ".join(names)), "gpu_count": len(gpus),
        "gpu_memory_mib": int(memory.group(1)) if memory else None,
        "gpu_driver": _clean(first.get("driver_version"), 64) or None,
        "gpu_compute_capability": cc if re.fullmatch(r"\d+\.\d+", cc) else None,
    }


def parse_nvidia_smi_banner(text: str) -> dict:
    """The CUDA and driver versions from the banner that plain `nvidia-smi` prints."""
    found = {}
    if match := re.search(r"CUDA Version:\s*([\d.]+)", text):
        found["cuda_version"] = match.group(1)
    if match := re.search(r"Driver Version:\s*([\d.]+)", text):
        found["gpu_driver"] = match.group(1)
    return found


def parse_clinfo(text: str) -> dict:
    """`clinfo` (default human-readable format): the first GPU device's name, version, memory."""
    devices: list[dict[str, str]] = []
    for line in text.splitlines():
        match = re.match(r"^\s*(\S.*?)\s{2,}(\S.*?)\s*$", line)
        if not match:
            continue
        key, value = match.group(1), match.group(2)
        if key == "Device Name":
            devices.append({})
        if devices and key not in devices[-1]:
            devices[-1][key] = value
    gpus = [d for d in devices if "GPU" in d.get("Device Type", "GPU").upper()]
    if not gpus:
        return {}
    device = gpus[0]
    memory = re.match(r"(\d+)", device.get("Global memory size", ""))
    return {
        "opencl_device": _clean(device.get("Device Name")) or None,
        "opencl_version": _clean(device.get("Device Version")) or None,
        "opencl_memory_mib": int(memory.group(1)) >> 20 if memory else None,
    }


# ---------------------------------------------------------------------------------------------
# Probing a device

SECTION = "@@kiln-section "
FILE = "@@kiln-file "
NVIDIA_QUERY = "name,memory.total,driver_version"
# Kiln's own probe script: every command is a constant; outputs are separated by section lines.
PROBE = "\n".join([
    f"s() {{ printf '\\n{SECTION}%s\\n' \"$1\"; }}",
    "s uname-a; uname -a 2>/dev/null",
    "s uname-m; uname -m 2>/dev/null",
    "s cpuinfo; cat /proc/cpuinfo 2>/dev/null",
    "s possible; cat /sys/devices/system/cpu/possible 2>/dev/null",
    "s getprop; getprop 2>/dev/null",
    (f"s nvidia-smi-csv; nvidia-smi --query-gpu={NVIDIA_QUERY},compute_cap --format=csv "
     f"2>/dev/null || nvidia-smi --query-gpu={NVIDIA_QUERY} --format=csv 2>/dev/null"),
    "s nvidia-smi; nvidia-smi 2>/dev/null | head -n 8",
    "s clinfo; clinfo 2>/dev/null",
    "s end",
])
CACHE_INDEXES = 8
CACHE_FILES = ("level", "type", "size")
FREQ_FILES = ("cpuinfo_min_freq", "cpuinfo_max_freq")


def split_sections(text: str, marker: str = SECTION) -> dict[str, str]:
    """Probe output -> section name -> text (the marker lines removed)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(marker):
            current = sections.setdefault(line[len(marker):].strip(), [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip("\n") for name, lines in sections.items()}


def file_probe(cpus: Sequence[int]) -> str:
    """A script printing cpufreq files of `cpus` and cpu0's cache files, each after a marker."""
    numbers = " ".join(str(int(c)) for c in cpus[:MAX_CPUS])
    return "\n".join([
        f"f() {{ printf '\\n{FILE}%s\\n' \"$1\"; cat \"$1\" 2>/dev/null; }}",
        (f"for i in {numbers}; do for n in {' '.join(FREQ_FILES)}; do "
         f"f /sys/devices/system/cpu/cpu$i/cpufreq/$n; done; done"),
        (f"for j in {' '.join(str(i) for i in range(CACHE_INDEXES))}; do for n in "
         f"{' '.join(CACHE_FILES)}; do f /sys/devices/system/cpu/cpu0/cache/index$j/$n; done; "
         f"done"),
    ])


def facts_from_probe(probe: str, files: str, transport: Transport) -> HardwareFacts:
    """Combine the outputs of `PROBE` and `file_probe` into HardwareFacts."""
    sections = split_sections(probe)
    if "end" not in sections:
        raise FactsError("the device's probe output is incomplete (no end marker)")
    file_texts = split_sections(files, FILE)
    uname = parse_uname(sections.get("uname-a", ""))
    cpu = parse_cpuinfo(sections.get("cpuinfo", ""))
    props = parse_getprop(sections.get("getprop", ""))
    arch = normalize_arch(sections.get("uname-m", "").strip() or uname["machine"])
    if not arch:
        raise FactsError("the device did not report its architecture (uname -m)")
    cores = cpu["logical_cores"] or len(parse_possible(sections.get("possible", "")))
    if not cores:
        raise FactsError("the device reported no processors in /proc/cpuinfo")
    caches = parse_caches(tuple(file_texts.get(f"/sys/devices/system/cpu/cpu0/cache/index{j}/{n}")
                                for n in CACHE_FILES) for j in range(CACHE_INDEXES))
    gpu = parse_nvidia_smi_csv(sections.get("nvidia-smi-csv", ""))
    if gpu:
        banner = parse_nvidia_smi_banner(sections.get("nvidia-smi", ""))
        gpu["cuda_version"] = banner.get("cuda_version")
        gpu["gpu_driver"] = gpu.get("gpu_driver") or banner.get("gpu_driver")
    opencl = parse_clinfo(sections.get("clinfo", ""))
    android = bool(props.get("ro.build.version.sdk"))
    facts: dict = {
        "arch": arch,
        "abi": _clean(props.get("ro.product.cpu.abi"), 32) or arch,
        "cpu_vendor": cpu["cpu_vendor"],
        "cpu_model": cpu["cpu_model"] or arch,
        "core_types": cpu["core_types"],
        "logical_cores": cores,
        "isa": isa_features(cpu["flags"], arch),
        **parse_cpufreq(file_texts), **caches,
        **{k: v for k, v in gpu.items() if v is not None},
        "opencl_version": opencl.get("opencl_version"),
        "opencl_device": opencl.get("opencl_device"),
    }
    if not gpu.get("gpu_model") and opencl.get("opencl_device"):
        facts |= {"gpu_model": opencl["opencl_device"], "gpu_count": 1,
                  "gpu_memory_mib": opencl.get("opencl_memory_mib")}
    if android:
        soc = _clean(f"{props.get('ro.soc.manufacturer', '')} {props.get('ro.soc.model', '')}")
        facts |= {
            "os": _clean(f"Android {props.get('ro.build.version.release', '?')} "
                         f"(API {props['ro.build.version.sdk']})"),
            "os_build": _clean(props.get("ro.build.fingerprint")),
            "device_model": _clean(f"{props.get('ro.product.manufacturer', '')} "
                                   f"{props.get('ro.product.model', '')}"),
            "cpu_model": soc or cpu["cpu_model"] or _clean(props.get("ro.board.platform")) or arch,
            "emulated": props.get("ro.kernel.qemu") == "1" or props.get("ro.boot.qemu") == "1",
        }
    else:
        facts |= {"os": _clean(f"{uname['system'] or 'unknown'} {uname['release']}"),
                  "os_build": uname["build"]}
    if transport == "adb" or android:
        kind = "phone"
    elif facts.get("gpu_model"):
        kind = "gpu-host"
    else:
        kind = "cpu"
    return HardwareFacts(kind=kind, **facts)


RunFn = Callable[[list[str], float], Awaitable[tuple[int, str, str]]]


async def collect_facts(run: RunFn, transport: Transport, timeout: float = 60.0) -> HardwareFacts:
    """Run the probes through `run(argv, timeout)` on the device and parse what they print."""
    code, probe, err = await run(["sh", "-c", PROBE], timeout)
    if code != 0 and SECTION + "end" not in probe:
        raise FactsError(f"the facts probe failed on the device (exit status {code}): "
                         f"{_clean(err or probe)}")
    cpus = parse_possible(split_sections(probe).get("possible", "")) or [0]
    _, files, _ = await run(["sh", "-c", file_probe(cpus)], timeout)
    return facts_from_probe(probe, files, transport)
