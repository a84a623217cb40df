"""Errors a user can act on.

Everything qwen2om raises on bad input derives from :class:`Qwen2omError`; the CLI prints its
message on one line and exits non-zero, without a traceback. Anything else is a bug.
"""

from __future__ import annotations


class Qwen2omError(Exception):
    """A problem with the user's input or environment, described well enough to fix it."""

    exit_code = 2
    keep_partial = False  # True: the staging directory holds work --resume can continue
    label = "error"


class CheckpointError(Qwen2omError):
    """The checkpoint directory is missing, unreadable or inconsistent with its config."""


class RecipeError(Qwen2omError):
    """A recipe or a --set override is invalid."""


class PlanError(Qwen2omError):
    """The pass pipeline cannot run in the order given."""


class OutputExistsError(Qwen2omError):
    """The output directory exists and --force was not given."""



class Interrupted(Qwen2omError):
    """Ctrl-C or SIGTERM: the output was not written; what was finished is kept for --resume."""

    exit_code = 130
    keep_partial = True
    label = "interrupted"


class DiskFullError(Qwen2omError):
    """The disk filled while writing; finished work is kept for --resume once space exists."""

    keep_partial = True
