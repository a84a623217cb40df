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


def caused_by_interrupt(e: BaseException) -> bool:
    """Whether a Ctrl-C is somewhere in `e`'s chain: libraries that catch everything (torch.export wraps
    whatever its tracing raised in its own error) would otherwise turn an interrupt into a failure."""
    seen: set[int] = set()
    chain: BaseException | None = e
    while chain is not None and id(chain) not in seen:
        if isinstance(chain, KeyboardInterrupt):
            return True
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    return False


class DiskFullError(Qwen2omError):
    """The disk filled while writing; finished work is kept for --resume once space exists."""

    keep_partial = True
