"""Exceptions a user can cause. The CLI prints their message on one line and exits 2."""

from __future__ import annotations


class AccelError(Exception):
    """Base of every error accel raises on purpose."""


class UserError(AccelError, ValueError):
    """Bad input: a recipe, a flag, a model name. The message alone must tell the user what to fix."""


class RecipeError(UserError):
    """A recipe (file, dict or CLI override) that does not validate."""


class NotAvailableError(UserError):
    """A recipe asks for a feature that has not landed yet; refusing beats silently ignoring it."""


class ModelError(UserError):
    """An unknown model, one not available locally, or a pipeline no family supports."""


def first_line(error: BaseException) -> str:
    """An exception as one line for a user's message: its first line, else its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def os_reason(error: OSError) -> str:
    """ "no space left on device": the OS's words, else the exception's own."""
    return error.strerror.lower() if error.strerror else (str(error) or type(error).__name__)
