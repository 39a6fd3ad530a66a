"""hilt: hardware-in-the-loop low-precision inference.

The packages: hilt.quant, hilt.kernels, hilt.fp8, hilt.cim_sim, and hilt.bench (the built-in
workloads and studies); hilt.cli is the `hilt` command. Importing this module imports nothing.
"""


def __getattr__(name: str):
    # __version__ on first use: importlib.metadata costs more than `hilt --help` itself
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("hilt")
        except PackageNotFoundError:  # run from a source tree that was never installed
            value = "0+unknown"
        globals()["__version__"] = value
        return value
    raise AttributeError(f"module 'hilt' has no attribute {name!r}")
