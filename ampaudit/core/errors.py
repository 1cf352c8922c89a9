"""Errors that end a run with exit code 2 and a one-line message (never a traceback)."""

from __future__ import annotations


class AmpauditError(Exception):
    """Base class: ``str(err)`` is the one-line message shown to the user."""

    exit_code = 2


class UsageError(AmpauditError):
    """Bad command line, configuration or policy file."""


class LoadError(AmpauditError):
    """The model file or its entry point could not be loaded or run."""


class NoModelFound(LoadError):
    """The file defines no model entry point ampaudit can use."""
