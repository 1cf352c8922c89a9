"""Errors that end a run with a one-line message (never a traceback): exit code 2, or 1 for a
result that failed its check (VerificationFailed)."""

from __future__ import annotations

# What the user's code (a model's import, factory, forward, example_inputs()) may raise that
# ampaudit reports as that code's failure: exit() and GeneratorExit too, but never Ctrl-C.
USER_CODE_ERRORS = (Exception, SystemExit, GeneratorExit)


class AmpauditError(Exception):
    """Base class: ``str(err)`` is the one-line message shown to the user."""

    exit_code = 2

    def __reduce__(self) -> tuple:
        # pickled whole (keyword-only fields too): a child process raises it in its parent (core/child.py)
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type[AmpauditError], args: tuple, state: dict) -> AmpauditError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class UsageError(AmpauditError):
    """Bad command line, configuration or policy file."""


class VerificationFailed(AmpauditError):
    """The work was done but its result failed a check (an export whose forward raises): exit 1."""

    exit_code = 1


class LoadError(AmpauditError):
    """The model file or its entry point could not be loaded or run."""


class NoModelFound(LoadError):
    """The file defines no model entry point ampaudit can use."""


class ModelNotBuilt(LoadError):
    """Importing the model file, or building the model it defines, failed. The graph audit
    cannot run, but the file can still be linted: ``reason`` says what failed, ``hint`` how to
    get the audit, ``line`` where in the file (None when unknown)."""

    def __init__(self, message: str, *, reason: str, hint: str, line: int | None = None) -> None:
        super().__init__(message)
        self.reason, self.hint, self.line = reason, hint, line
