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
  whether the device is emulated.

Kernel signatures do not name a backend, so a device's measurements of OpenCL kernels are filed
under another key than those of its C kernels: `device_class` of the device and the target, a
fingerprint of the OpenCL device Kiln's runner picks there (a phone's GPU, PoCL on a CPU host). Frequencies (governors, thermal caps, kernel tables), OS versions
  and builds, driver, CUDA and OpenCL versions are recorded but left out: the same hardware keeps
  its fingerprint across governors and OS updates.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    computed_field,
    field_validator,
)

from kiln.cpuinfo import (
    TEXT_LIMIT,
    isa_features,
    normalize_arch,
    parse_caches,
    parse_cpuinfo,
)
from kiln.cpuinfo import clean_text as _clean
from kiln.cpuinfo import parse_int as _int
from kiln.errors import KilnError
from kiln.profile.machine import ISA_FEATURES, static_fingerprint
from kiln.target import runnable_targets, target

FACTS_VERSION = 1
DeviceKind = Literal["cpu", "phone", "gpu-host"]
Transport = Literal["local", "ssh", "adb"]
MAX_CPUS = 1024

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
        (), max_length=128)  # sorted; names from kiln.cpuinfo's X86_ISA / ARM_ISA
    gpu_model: str | None = Field(None, max_length=TEXT_LIMIT)
    gpu_count: int = Field(0, ge=0, le=64)
    gpu_memory_mib: int | None = Field(None, ge=0)
    gpu_driver: str | None = Field(None, max_length=64)
    gpu_compute_capability: str | None = Field(None, max_length=16)
    cuda_version: str | None = Field(None, max_length=32)
    opencl_version: str | None = Field(None, max_length=TEXT_LIMIT)
    opencl_device: str | None = Field(None, max_length=TEXT_LIMIT)
    opencl_gpu: bool = False  # whether opencl_device is a GPU (else a CPU or an accelerator)
    opencl_local_memory_bytes: int | None = Field(None, ge=0)
    opencl_max_work_group_size: int | None = Field(None, ge=0)
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


def device_targets(facts: Mapping) -> list[str]:
    """The Kiln targets (`kiln.target.TARGET_NAMES`) whose artifacts a device with these facts
    (a `HardwareFacts` as stored: a dict) runs: its architecture and ISA, and OpenCL where it has
    an OpenCL device, CUDA where its NVIDIA GPU runs the target's code."""
    from device_agents.matching import device_capability

    runtimes = ["opencl"] if facts.get("opencl_device") else []
    return list(runnable_targets(str(facts.get("arch", "")), facts.get("isa") or (), runtimes,
                                 device_capability(facts)))


def device_class(fingerprint: str, facts: Mapping, target_name: str) -> str:
    """The key the device's (`fingerprint`, `facts`) measurements of an artifact for
    `target_name` are filed under in the profile database: its fingerprint for kernels that run on
    its CPU; for kernels on a device of its own (OpenCL, CUDA), a fingerprint of that device."""
    if _runs_on_cpu(target_name):
        return fingerprint
    identity = {"version": FACTS_VERSION, "device": fingerprint,
                "backend": target(target_name).backend, "opencl": facts.get("opencl_device"),
                "opencl_gpu": bool(facts.get("opencl_gpu"))}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def has_driver_for(facts: Mapping, target_name: str) -> bool:
    """Whether a device has the driver an artifact for `target_name` needs: always for a target
    whose kernels run on the CPU (its architecture and ISA are checked apart), else the target
    must be among `device_targets`."""
    if _runs_on_cpu(target_name):
        return True
    return target_name in device_targets(facts)


def _runs_on_cpu(target_name: str) -> bool:
    """Whether a target's kernels run on the CPU; a name Kiln does not know counts as a CPU's."""
    try:
        return target(target_name).runs_on_cpu
    except KilnError:
        return True


# ---------------------------------------------------------------------------------------------
# Parsers: text -> dict of facts

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
    """`clinfo` (default human-readable format): the device Kiln's OpenCL runner picks (the first
    GPU, else the first device of any type): name, version, memory, whether it is a GPU, local
    memory size and largest work-group."""
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
    # clinfo names each device again under "NULL platform behavior", without its type: only
    # entries that state a type are devices.
    typed = [d for d in devices if d.get("Device Type")]
    gpus = [d for d in typed if "GPU" in d["Device Type"].upper()]
    named = [d for d in typed if _clean(d.get("Device Name"))]
    if not gpus and not named:
        return {}
    device = gpus[0] if gpus else named[0]
    memory = re.match(r"(\d+)", device.get("Global memory size", ""))
    return {
        "opencl_device": _clean(device.get("Device Name")) or None,
        "opencl_version": _clean(device.get("Device Version")) or None,
        "opencl_memory_mib": int(memory.group(1)) >> 20 if memory else None,
        "opencl_gpu": bool(gpus),
        "opencl_local_memory_bytes": _int(device.get("Local memory size", "").split(" ")[0]),
        "opencl_max_work_group_size": _int(device.get("Max work group size", "")),
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
        **{k: v for k, v in opencl.items() if k != "opencl_memory_mib" and v is not None},
    }
    if not gpu.get("gpu_model") and opencl.get("opencl_gpu"):
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
