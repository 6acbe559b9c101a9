"""scikit-build-core with one extra rule: CUDA build requirements only when CUDA is built.

The CUDA part needs the cuBLASLt header (from the ``nvidia-cublas`` wheel when the CUDA
toolkit on the machine has none) and CUTLASS's headers (``nvidia-cutlass``). Asking for
them unconditionally would make every CPU-only install download ~450 MB, so they are
added only when the build will compile CUDA: ``JAXFUSE_CUDA`` is ON, or AUTO with
``nvcc`` on the PATH (or under ``CUDA_HOME``/``CUDA_PATH``).
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core.build import *  # noqa: F401,F403  (re-export the PEP 517 hooks)
from scikit_build_core.build import (
    get_requires_for_build_editable as _requires_editable,
    get_requires_for_build_wheel as _requires_wheel,
)

CUDA_BUILD_REQUIRES = ["nvidia-cublas>=13.0,<14", "nvidia-cutlass>=4.2,<5"]


def _nvcc_found() -> bool:
    if shutil.which("nvcc"):
        return True
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(variable)
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return True
    return os.path.exists("/usr/local/cuda/bin/nvcc")


def _cuda_requires() -> list[str]:
    mode = os.environ.get("JAXFUSE_CUDA", "AUTO").upper()
    if mode == "OFF" or (mode == "AUTO" and not _nvcc_found()):
        return []
    return list(CUDA_BUILD_REQUIRES)


def get_requires_for_build_wheel(config_settings=None):
    return [*_requires_wheel(config_settings), *_cuda_requires()]


def get_requires_for_build_editable(config_settings=None):
    return [*_requires_editable(config_settings), *_cuda_requires()]
