"""The package version, in a module of its own so that any layer can import it without importing `keel`."""

__version__ = "0.1.0"
