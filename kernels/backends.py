"""Where the Triton code is loaded: the one place that knows whether Triton is installed and
whether its CPU interpreter was asked for. Importing this module imports nothing heavy."""

import importlib
import os
import sys

from hilt.errors import HiltError

TRITON_MODULES = ("lut_matmul_triton", "fp8_attention_triton")


def triton_kernels(name: str, interpret: bool = False):
    """The module ``hilt.kernels.<name>`` with the Triton kernels, imported on first use.

    ``interpret=True`` runs its kernels in Triton's CPU interpreter (how CPU-only machines check
    them). Triton reads that choice when it is imported, so it is made here, before that, and
    holds for the rest of the process."""
    if name not in TRITON_MODULES:
        raise HiltError(f"no Triton kernel module {name!r}; there are {', '.join(TRITON_MODULES)}")
    module = f"hilt.kernels.{name}"
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton defines its own library functions (tl.cdiv, ...) when it is imported: the
        # interpreter must be chosen before that
        if "triton" in sys.modules:
            raise HiltError("Triton was already imported in this process without its interpreter; "
                            "run the CPU check in a new process (hilt bench kernels --check)")
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        raise HiltError("Triton is not installed (it has wheels for Linux only), so the GPU kernels cannot run here; "
                        "CPU tensors take the PyTorch reference path") from None
    return importlib.import_module(module)
