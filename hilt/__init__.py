"""hilt: hardware-in-the-loop low-precision inference.

The library: hilt.kernels, hilt.quant, hilt.fp8, hilt.cim_sim. Above it: hilt.data and hilt.models
(the built-in workloads), hilt.tasks (what the commands run), hilt.bench (studies and timings) and
hilt.cli (the `hilt` command; docs/architecture.md). Importing this module imports nothing;
it arranges that transformers, once its quantizer registry is imported, knows hilt's folders
(``quant_method: "hilt"``, hilt.quant.hf_quantizer).
"""

import sys

_HF_REGISTRY = "transformers.quantizers.auto"


def _register_with_transformers() -> None:
    try:
        from hilt.quant.hf_quantizer import register

        register()
    except Exception as e:  # never break transformers' own import
        import warnings

        warnings.warn(f"hilt could not register its quantizer with transformers: {e}", stacklevel=2)


class _AfterImport:
    """A meta-path finder that runs the registration right after transformers' quantizer registry is
    imported: `import hilt` stays free, and importing that registry costs seconds."""

    def find_spec(self, name, path=None, target=None):
        if name != _HF_REGISTRY:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_register(module):
                exec_module(module)
                _register_with_transformers()

            spec.loader.exec_module = exec_then_register
        return spec


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


if _HF_REGISTRY in sys.modules:
    _register_with_transformers()
elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
