"""Batch jobs run by `python -m engine.run job=<name>`: each module has run(cfg)."""
from engine.errors import UserError


class JobError(UserError):
    """A job-level problem (bad input file, missing column, ...): reported in one line, exit code 1."""


def first_line(err: Exception) -> str:
    """The first line of an exception's message (its type's name when empty), for one-line reports."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
