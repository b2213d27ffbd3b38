#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine (Python packages, the aarch64 cross
# compiler, qemu-user, openssh-server and PoCL's OpenCL runtime), then runs it. Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)  # the ssh backend's tests start a real sshd
command -v chromium >/dev/null || missing+=(chromium)  # the dashboard's browser tests
command -v chromedriver >/dev/null || missing+=(chromium-driver)
# the OpenCL backend's tests run kernels on PoCL (a real OpenCL runtime on the CPU)
[ -e /etc/OpenCL/vendors/pocl.icd ] || missing+=(pocl-opencl-icd ocl-icd-opencl-dev opencl-headers clinfo)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

python3 -m pip install -q --disable-pip-version-check -e ".[test,zoo,service,cuda]"
exec python3 -m pytest -q -p no:cacheprovider "$@"
