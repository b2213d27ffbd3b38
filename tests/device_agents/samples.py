"""Captured outputs of the commands the facts probe runs, for the parsers' tests and the stand-in phone.

X86_CPUINFO is /proc/cpuinfo of the machine these tests were written on (a 2-vCPU AMD EPYC VM).
The others are written out in their tools' exact formats: a Pixel 7 (Google Tensor G2: 4x
Cortex-A55, 2x Cortex-A78, 2x Cortex-X1) for /proc/cpuinfo, sysfs and getprop, an H100 host for
nvidia-smi, and clinfo on an NVIDIA host and on a Snapdragon phone.
"""
from __future__ import annotations

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
microcode\t: 0x1000065
cpu MHz\t\t: 2596.122
cache size\t: 1024 KB
physical id\t: 0
siblings\t: 2
core id\t\t: 0
cpu cores\t: 2
apicid\t\t: 0
initial apicid\t: 0
fpu\t\t: yes
fpu_exception\t: yes
cpuid level\t: 28
wp\t\t: yes
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 clzero xsaveerptr arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm avx512_vp2intersect
bugs\t\t: sysret_ss_attrs null_seg spectre_v1 spectre_v2 spec_store_bypass srso spectre_v2_user
bogomips\t: 5192.24
TLB size\t: 192 4K pages
clflush size\t: 64
cache_alignment\t: 64
address sizes\t: 48 bits physical, 48 bits virtual
power management:

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
microcode\t: 0x1000065
cpu MHz\t\t: 2596.122
cache size\t: 1024 KB
physical id\t: 0
siblings\t: 2
core id\t\t: 1
cpu cores\t: 2
apicid\t\t: 1
initial apicid\t: 1
fpu\t\t: yes
fpu_exception\t: yes
cpuid level\t: 28
wp\t\t: yes
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 clzero xsaveerptr arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm avx512_vp2intersect
bugs\t\t: sysret_ss_attrs null_seg spectre_v1 spectre_v2 spec_store_bypass srso spectre_v2_user
bogomips\t: 5192.24
TLB size\t: 192 4K pages
clflush size\t: 64
cache_alignment\t: 64
address sizes\t: 48 bits physical, 48 bits virtual
power management:

"""

X86_CACHES = [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", "1024K"),
              ("3", "Unified", "32768K")]

X86_UNAME = "Linux vm 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0 x86_64 GNU/Linux"

ARM64_CPUINFO = """processor\t: 0
BogoMIPS\t: 49.15
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x2
CPU part\t: 0xd05
CPU revision\t: 0

processor\t: 1
BogoMIPS\t: 49.15
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x2
CPU part\t: 0xd05
CPU revision\t: 0

processor\t: 2
BogoMIPS\t: 49.15
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x2
CPU part\t: 0xd05
CPU revision\t: 0

processor\t: 3
BogoMIPS\t: 49.15
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x2
CPU part\t: 0xd05
CPU revision\t: 0

processor\t: 4
BogoMIPS\t: 49.15
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd41
CPU revision\t: 0

processor\t: 5
BogoMIPS\t: 49.15
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd41
CPU revision\t: 0

processor\t: 6
BogoMIPS\t: 49.15
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd44
CPU revision\t: 0

processor\t: 7
BogoMIPS\t: 49.15
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd44
CPU revision\t: 0
"""

ARM64_CPUFREQ = {  # (cpuinfo_min_freq, cpuinfo_max_freq) in kHz per CPU: three clusters
    **{i: ("300000", "1803000") for i in range(4)},
    **{i: ("400000", "2348000") for i in (4, 5)},
    **{i: ("500000", "2850000") for i in (6, 7)},
}

ARM64_CACHES = [("1", "Data", "32K"), ("1", "Instruction", "32K"), ("2", "Unified", "128K"),
                ("3", "Unified", "4096K")]

ANDROID_UNAME = ("Linux localhost 5.10.157-android13-4-00001-g5c7ff5dc7aac-ab10381520 #1 SMP "
                 "PREEMPT Thu Jun 29 11:59:24 UTC 2023 aarch64 Toybox")

PIXEL7_GETPROP = """[dalvik.vm.heapsize]: [512m]
[persist.sys.timezone]: [Europe/London]
[ro.board.platform]: [gs201]
[ro.boot.hardware.platform]: [gs201]
[ro.build.fingerprint]: [google/panther/panther:14/UQ1A.240205.004/11269751:user/release-keys]
[ro.build.version.release]: [14]
[ro.build.version.sdk]: [34]
[ro.hardware]: [panther]
[ro.hardware.egl]: [mali]
[ro.product.brand]: [google]
[ro.product.cpu.abi]: [arm64-v8a]
[ro.product.cpu.abilist]: [arm64-v8a,armeabi-v7a,armeabi]
[ro.product.device]: [panther]
[ro.product.manufacturer]: [Google]
[ro.product.model]: [Pixel 7]
[ro.soc.manufacturer]: [Google]
[ro.soc.model]: [GS201]
[sys.boot_completed]: [1]
"""

NVIDIA_SMI_CSV = """name, memory.total [MiB], driver_version, compute_cap
NVIDIA H100 80GB HBM3, 81559 MiB, 535.104.05, 9.0
"""

NVIDIA_SMI_CSV_TWO_GPUS_OLD_DRIVER = """name, memory.total [MiB], driver_version
Tesla V100-SXM2-16GB, 16384 MiB, 450.80.02
Tesla V100-SXM2-16GB, 16384 MiB, 450.80.02
"""

NVIDIA_SMI_BANNER = """Tue Mar  5 10:12:01 2024
+---------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.104.05             Driver Version: 535.104.05   CUDA Version: 12.2     |
|-----------------------------------------+----------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |         Memory-Usage | GPU-Util  Compute M. |
"""

CLINFO_NVIDIA = """Number of platforms                               1
  Platform Name                                   NVIDIA CUDA
  Platform Vendor                                 NVIDIA Corporation
  Platform Version                                OpenCL 3.0 CUDA 12.2.138
  Platform Profile                                FULL_PROFILE
  Platform Extensions                             cl_khr_global_int32_base_atomics cl_khr_fp64
  Platform Extensions function suffix             NV

  Platform Name                                   NVIDIA CUDA
Number of devices                                 1
  Device Name                                     NVIDIA H100 80GB HBM3
  Device Vendor                                   NVIDIA Corporation
  Device Vendor ID                                0x10de
  Device Version                                  OpenCL 3.0 CUDA
  Driver Version                                  535.104.05
  Device OpenCL C Version                         OpenCL C 1.2
  Device Type                                     GPU
  Device Topology (NV)                            PCI-E, 0000:19:00.0
  Device Profile                                  FULL_PROFILE
  Device Available                                Yes
  Compiler Available                              Yes
  Linker Available                                Yes
  Max compute units                               132
  Max clock frequency                             1980MHz
  Compute Capability (NV)                         9.0
  Global memory size                              85520809984 (79.65GiB)
  Max memory allocation                           21380202496 (19.91GiB)

NULL platform behavior
  clGetPlatformInfo(NULL, CL_PLATFORM_NAME, ...)  No platform
"""

CLINFO_ADRENO = """Number of platforms                               1
  Platform Name                                   QUALCOMM Snapdragon(TM)
  Platform Vendor                                 QUALCOMM
  Platform Version                                OpenCL 3.0 QUALCOMM build: commit unknown Compiler E031.42.23.01
  Platform Profile                                FULL_PROFILE

  Platform Name                                   QUALCOMM Snapdragon(TM)
Number of devices                                 1
  Device Name                                     QUALCOMM Adreno(TM) 740
  Device Vendor                                   QUALCOMM
  Device Vendor ID                                0x5143
  Device Version                                  OpenCL 3.0 Adreno(TM) 740
  Driver Version                                  OpenCL 3.0 QUALCOMM build: commit unknown Compiler E031.42.23.01
  Device OpenCL C Version                         OpenCL C 3.0 Adreno(TM) 740
  Device Type                                     GPU
  Max compute units                               6
  Max clock frequency                             1MHz
  Global memory size                              3911180288 (3.643GiB)
"""

CLINFO_CPU_ONLY = """Number of platforms                               1
  Platform Name                                   Portable Computing Language
  Platform Vendor                                 The pocl project
  Platform Version                                OpenCL 3.0 PoCL 3.1+debian  Linux, None+Asserts, RELOC, LLVM 15.0.6, SLEEF, DISTRO, POCL_DEBUG

  Platform Name                                   Portable Computing Language
Number of devices                                 1
  Device Name                                     cpu-haswell-AMD EPYC
  Device Vendor                                   AuthenticAMD
  Device Version                                  OpenCL 3.0 PoCL HSTR: cpu-x86_64-pc-linux-gnu-haswell
  Device Type                                     CPU
  Global memory size                              6283923456 (5.852GiB)

NULL platform behavior
  clGetPlatformInfo(NULL, CL_PLATFORM_NAME, ...)  Portable Computing Language
  clGetDeviceIDs(NULL, CL_DEVICE_TYPE_ALL, ...)   Success [POCL]
  clCreateContext(NULL, ...) [default]            Success [POCL]
  clCreateContextFromType(NULL, CL_DEVICE_TYPE_DEFAULT)  Success (1)
    Platform Name                                 Portable Computing Language
    Device Name                                   cpu-haswell-AMD EPYC
  clCreateContextFromType(NULL, CL_DEVICE_TYPE_GPU)  No devices found in platform
  clCreateContextFromType(NULL, CL_DEVICE_TYPE_ALL)  Success (1)
    Platform Name                                 Portable Computing Language
    Device Name                                   cpu-haswell-AMD EPYC
"""


def sysfs_files(cpufreq: dict[int, tuple[str, str]], caches: list[tuple[str, str, str]]) -> dict[str, str]:
    """sysfs path -> contents for cpufreq limits and cpu0's caches."""
    files = {}
    for cpu, (low, high) in cpufreq.items():
        base = f"/sys/devices/system/cpu/cpu{cpu}/cpufreq"
        files[f"{base}/cpuinfo_min_freq"] = low + "\n"
        files[f"{base}/cpuinfo_max_freq"] = high + "\n"
        files[f"{base}/scaling_governor"] = "schedutil\n"
    for index, (level, kind, size) in enumerate(caches):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        files[f"{base}/level"], files[f"{base}/type"] = level + "\n", kind + "\n"
        files[f"{base}/size"] = size + "\n"
    return files


def probe_output(sections: dict[str, str]) -> str:
    """What device_agents.facts.PROBE prints, given each section's text."""
    names = ["uname-a", "uname-m", "cpuinfo", "possible", "getprop", "nvidia-smi-csv",
             "nvidia-smi", "clinfo"]
    return "".join(f"\n@@kiln-section {n}\n{sections.get(n, '')}" for n in names) + "\n@@kiln-section end\n"


def file_probe_output(files: dict[str, str]) -> str:
    """What device_agents.facts.file_probe prints for these files."""
    return "".join(f"\n@@kiln-file {path}\n{text}" for path, text in files.items())


# The stand-in phone of the adb tests: a Pixel 7's hardware, marked as an emulator.
STANDIN_PROPS = {
    line[1:line.index("]")]: line[line.index(": [") + 3:-1]
    for line in PIXEL7_GETPROP.splitlines()
} | {"ro.product.model": "Kiln Stand-in", "ro.kernel.qemu": "1"}
STANDIN_FILES = {"/proc/cpuinfo": ARM64_CPUINFO, "/sys/devices/system/cpu/possible": "0-7\n",
                  **sysfs_files(ARM64_CPUFREQ, ARM64_CACHES)}
