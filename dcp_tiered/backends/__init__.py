"""Storage backends: the only modules that touch files or object stores."""

from .local import LocalBackend

__all__ = ["LocalBackend"]
