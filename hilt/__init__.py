"""hilt: the command line. Parses arguments, calls the packages, prints."""


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
