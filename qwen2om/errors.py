"""Errors a user can act on.

Everything qwen2om raises on bad input derives from :class:`Qwen2omError`; the CLI prints its
message on one line and exits non-zero, without a traceback. Anything else is a bug.
"""

from __future__ import annotations


class Qwen2omError(Exception):
    """A problem with the user's input or environment, described well enough to fix it."""

    exit_code = 2


class CheckpointError(Qwen2omError):
    """The checkpoint directory is missing, unreadable or inconsistent with its config."""


class RecipeError(Qwen2omError):
    """A recipe or a --set override is invalid."""


class PlanError(Qwen2omError):
    """The pass pipeline cannot run in the order given."""


class OutputExistsError(Qwen2omError):
    """The output directory exists and --force was not given."""

