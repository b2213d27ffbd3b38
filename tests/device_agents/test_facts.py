"""Hardware facts: parsers on captured command outputs, the facts of a whole probe, fingerprints."""
from __future__ import annotations

import asyncio
import subprocess

import pytest

from device_agents import facts as f
from kiln.cpuinfo import parse_caches, parse_cpuinfo, parse_size
from kiln.profile.machine import static_facts
from tests.device_agents import samples as s


def test_x86_cpuinfo():
    cpu = parse_cpuinfo(s.X86_CPUINFO)
    assert cpu["cpu_vendor"] == "AuthenticAMD"
    assert cpu["cpu_model"] == "AMD EPYC"
    assert cpu["logical_cores"] == 2
    assert cpu["core_types"] == {}
    assert {"avx2", "fma", "avx512f", "avx512_vnni", "sse3", "sse4_2"} <= set(cpu["isa_features"])
    assert "hypervisor" not in cpu["isa_features"]  # only ISA features are recorded


def test_arm64_cpuinfo_names_core_types():
    cpu = parse_cpuinfo(s.ARM64_CPUINFO)
    assert cpu["logical_cores"] == 8
    assert cpu["core_types"] == {"Cortex-A55": 4, "Cortex-A78": 2, "Cortex-X1": 2}
    assert cpu["cpu_model"] == "4x Cortex-A55 + 2x Cortex-A78 + 2x Cortex-X1"
    assert cpu["cpu_vendor"] == "ARM"
    assert set(cpu["isa_features"]) == {"neon", "fp", "fp16", "dotprod", "atomics", "crc32", "aes",
                                        "sha2"}


def test_old_arm_kernel_hardware_line_and_unknown_part():
    text = ("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x51\nCPU part\t: 0x805\n\n"
            "Hardware\t: Qualcomm Technologies, Inc SDM845\n")
    cpu = parse_cpuinfo(text)
    assert cpu["cpu_model"] == "Qualcomm Technologies, Inc SDM845"
    assert cpu["core_types"] == {"Qualcomm part 0x805": 1}


def test_uname():
    assert f.parse_uname(s.X86_UNAME) == {
        "system": "Linux", "release": "6.18.44-fc-v657", "machine": "x86_64",
        "build": "Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0 x86_64 GNU/Linux"}
    android = f.parse_uname(s.ANDROID_UNAME)
    assert android["machine"] == "aarch64"
    assert "localhost" not in android["build"]  # the host name is not a fact


def test_getprop():
    props = f.parse_getprop(s.PIXEL7_GETPROP)
    assert props["ro.product.model"] == "Pixel 7"
    assert props["ro.product.cpu.abilist"] == "arm64-v8a,armeabi-v7a,armeabi"
    assert len(props) == s.PIXEL7_GETPROP.count("\n")


def test_sysfs_cpufreq_caches_and_possible():
    files = s.sysfs_files(s.ARM64_CPUFREQ, s.ARM64_CACHES)
    assert f.parse_cpufreq(files) == {"min_freq_khz": 300000, "max_freq_khz": 2850000}
    assert f.parse_cpufreq({}) == {"min_freq_khz": None, "max_freq_khz": None}
    assert parse_caches(s.X86_CACHES) == {"l1d_bytes": 48 << 10, "l1i_bytes": 32 << 10,
                                            "l2_bytes": 1 << 20, "l3_bytes": 32 << 20}
    assert parse_size("32M") == 32 << 20 and parse_size("garbage") is None
    assert f.parse_possible("0-7\n") == list(range(8))
    assert f.parse_possible("0,2-3") == [0, 2, 3]


def test_nvidia_smi():
    gpu = f.parse_nvidia_smi_csv(s.NVIDIA_SMI_CSV)
    assert gpu == {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "gpu_memory_mib": 81559,
                   "gpu_driver": "535.104.05", "gpu_compute_capability": "9.0"}
    old = f.parse_nvidia_smi_csv(s.NVIDIA_SMI_CSV_TWO_GPUS_OLD_DRIVER)
    assert old["gpu_count"] == 2 and old["gpu_compute_capability"] is None
    assert f.parse_nvidia_smi_banner(s.NVIDIA_SMI_BANNER) == {"cuda_version": "12.2",
                                                             "gpu_driver": "535.104.05"}
    assert f.parse_nvidia_smi_csv("") == {}


def test_clinfo():
    nvidia = f.parse_clinfo(s.CLINFO_NVIDIA)
    assert {k: nvidia[k] for k in ("opencl_device", "opencl_version", "opencl_memory_mib",
                                   "opencl_gpu")} == {
        "opencl_device": "NVIDIA H100 80GB HBM3", "opencl_version": "OpenCL 3.0 CUDA",
        "opencl_memory_mib": 85520809984 >> 20, "opencl_gpu": True}
    adreno = f.parse_clinfo(s.CLINFO_ADRENO)
    assert adreno["opencl_device"] == "QUALCOMM Adreno(TM) 740" and adreno["opencl_gpu"]
    pocl = f.parse_clinfo(s.CLINFO_CPU_ONLY)  # a CPU OpenCL device runs OpenCL, not as a GPU
    assert (pocl["opencl_device"], pocl["opencl_gpu"]) == ("cpu-haswell-AMD EPYC", False)
    later = ("NULL platform behavior\n  clCreateContext(NULL, ...) [default]"
             "         Success [P0]\n    Platform Name                                 "
             "Portable Computing Language\n    Device Name                                   "
             "cpu-haswell-AMD EPYC\n")  # names the device again, without its type
    assert f.parse_clinfo(s.CLINFO_CPU_ONLY + later) == pocl
    assert f.parse_clinfo("Number of platforms                               0\n") == {}


def test_a_cpu_opencl_device_is_recorded_but_is_no_gpu():
    sections = {"uname-a": s.X86_UNAME, "uname-m": "x86_64", "cpuinfo": s.X86_CPUINFO,
                "clinfo": s.CLINFO_CPU_ONLY}
    facts = f.facts_from_probe(s.probe_output(sections), "", "local")
    assert facts.kind == "cpu" and facts.gpu_model is None
    assert facts.opencl_device == "cpu-haswell-AMD EPYC"
    without = f.facts_from_probe(s.probe_output({k: v for k, v in sections.items()
                                                 if k != "clinfo"}), "", "local")
    assert without.fingerprint == facts.fingerprint  # C kernels run alike with or without PoCL
    dumped = facts.model_dump()
    assert f.device_class(facts.fingerprint, dumped, "x86_64") == facts.fingerprint
    opencl = f.device_class(facts.fingerprint, dumped, "opencl")
    assert opencl != facts.fingerprint and len(opencl) == 64  # OpenCL kernels: their own key
    other = dumped | {"opencl_device": "another-gpu", "opencl_gpu": True}
    assert f.device_class(facts.fingerprint, other, "opencl") != opencl


def test_targets_a_device_runs():
    cpu = {"arch": "x86_64", "isa": ["avx2", "fma", "sse4_2"]}
    assert f.device_targets(cpu) == ["x86_64"]
    assert f.device_targets(cpu | {"opencl_device": "pthread-x"}) == ["x86_64", "opencl"]
    assert f.device_targets({"arch": "x86_64", "isa": ["sse4_2"]}) == []  # no AVX2
    phone = phone_facts(clinfo=s.CLINFO_ADRENO).model_dump()
    assert f.device_targets(phone) == ["aarch64", "opencl-aarch64"]


def phone_facts(**changes) -> f.HardwareFacts:
    sections = {"uname-a": s.ANDROID_UNAME, "uname-m": "aarch64", "cpuinfo": s.ARM64_CPUINFO,
                "possible": "0-7", "getprop": s.PIXEL7_GETPROP} | changes
    files = s.sysfs_files(s.ARM64_CPUFREQ, s.ARM64_CACHES)
    return f.facts_from_probe(s.probe_output(sections), s.file_probe_output(files), "adb")


def test_phone_facts():
    facts = phone_facts()
    assert facts.kind == "phone"
    assert (facts.arch, facts.abi) == ("aarch64", "arm64-v8a")
    assert facts.os == "Android 14 (API 34)"
    assert facts.device_model == "Google Pixel 7"
    assert facts.cpu_model == "Google GS201"
    assert facts.core_types == {"Cortex-A55": 4, "Cortex-A78": 2, "Cortex-X1": 2}
    assert (facts.min_freq_khz, facts.max_freq_khz) == (300000, 2850000)
    assert (facts.l1d_bytes, facts.l2_bytes, facts.l3_bytes) == (32 << 10, 128 << 10, 4 << 20)
    assert "neon" in facts.isa and "dotprod" in facts.isa
    assert not facts.emulated and facts.gpu_model is None


def test_gpu_host_facts():
    sections = {"uname-a": s.X86_UNAME, "uname-m": "x86_64", "cpuinfo": s.X86_CPUINFO,
                "nvidia-smi-csv": s.NVIDIA_SMI_CSV, "nvidia-smi": s.NVIDIA_SMI_BANNER,
                "clinfo": s.CLINFO_NVIDIA}
    facts = f.facts_from_probe(s.probe_output(sections), "", "ssh")
    assert facts.kind == "gpu-host"
    assert (facts.gpu_model, facts.gpu_memory_mib, facts.cuda_version) == (
        "NVIDIA H100 80GB HBM3", 81559, "12.2")
    assert facts.opencl_version == "OpenCL 3.0 CUDA"
    assert facts.os == "Linux 6.18.44-fc-v657"
    cpu_only = f.facts_from_probe(s.probe_output({k: v for k, v in sections.items()
                                                  if "nvidia" not in k and k != "clinfo"}), "", "ssh")
    assert cpu_only.kind == "cpu"
    assert cpu_only.cpu_fingerprint == facts.cpu_fingerprint  # same CPU
    assert cpu_only.fingerprint != facts.fingerprint  # not the same device


def test_fingerprint_ignores_governors_os_and_drivers():
    base = phone_facts()
    slower = s.sysfs_files({i: ("300000", "1200000") for i in range(8)}, s.ARM64_CACHES)
    capped = f.facts_from_probe(
        s.probe_output({"uname-a": s.ANDROID_UNAME, "uname-m": "aarch64",
                        "cpuinfo": s.ARM64_CPUINFO, "possible": "0-7",
                        "getprop": s.PIXEL7_GETPROP.replace("[14]", "[15]").replace(
                            "UQ1A.240205.004", "AP4A.250105.002")}),
        s.file_probe_output(slower), "adb")
    assert capped.max_freq_khz == 1200000 and capped.os == "Android 15 (API 34)"
    assert capped.fingerprint == base.fingerprint
    other_phone = phone_facts(cpuinfo=s.ARM64_CPUINFO.replace("0xd44", "0xd4e"))
    assert other_phone.fingerprint != base.fingerprint
    emulator = phone_facts(getprop=s.PIXEL7_GETPROP + "[ro.kernel.qemu]: [1]\n")
    assert emulator.emulated and emulator.fingerprint != base.fingerprint


def test_facts_round_trip_through_json():
    facts = phone_facts()
    again = f.HardwareFacts.model_validate_json(facts.model_dump_json())
    assert again == facts and again.fingerprint == facts.fingerprint


def test_incomplete_probe_is_an_error():
    with pytest.raises(f.FactsError, match="incomplete"):
        f.facts_from_probe("@@kiln-section cpuinfo\nprocessor : 0\n", "", "local")
    with pytest.raises(f.FactsError, match="architecture"):
        f.facts_from_probe(s.probe_output({"cpuinfo": s.X86_CPUINFO}), "", "local")


def test_this_machine_matches_kilns_own_fingerprint():
    """The local CPU's facts give the key Kiln's SQLite profile store uses for this machine."""
    async def run(argv, timeout):
        done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True,
                                       timeout=timeout, check=False)
        return done.returncode, done.stdout, done.stderr

    facts = asyncio.run(f.collect_facts(run, "local"))
    assert facts.kind in ("cpu", "gpu-host")
    assert facts.cpu_fingerprint == static_facts()["fingerprint"]
