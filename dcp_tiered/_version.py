"""The package version, in a module of its own: modules below the package root read it without
importing the package (an import that would run back up the layers)."""

__version__ = "0.1.0"
