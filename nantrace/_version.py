"""The package version (a leaf, so that file writers need not import the package)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
