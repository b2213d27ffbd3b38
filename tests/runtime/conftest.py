import os
import shutil

import pytest

from kiln.runtime.artifact import build_artifact
from kiln.target import target
from tests.runtime.handmade import mlp


@pytest.fixture(scope="session", autouse=True)
def kiln_cache(tmp_path_factory):
    """Every runtime test builds and extracts into one fresh cache folder."""
    folder = tmp_path_factory.mktemp("kiln-cache")
    saved = os.environ.get("KILN_CACHE_DIR")
    os.environ["KILN_CACHE_DIR"] = str(folder)
    yield folder
    if saved is None:
        del os.environ["KILN_CACHE_DIR"]
    else:
        os.environ["KILN_CACHE_DIR"] = saved


@pytest.fixture(scope="session")
def mlp_model():
    return mlp()


@pytest.fixture(scope="session")
def mlp_artifact(mlp_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("artifacts") / "mlp.kiln"
    build_artifact(mlp_model.plan, mlp_model.kernels, target("host"), {"model": "mlp"}, path)
    return path


def cross_toolchain_missing() -> str | None:
    """Why aarch64 artifacts cannot be built and run here, or None."""
    for tool, package in (("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
                          ("qemu-aarch64", "qemu-user")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    return None
