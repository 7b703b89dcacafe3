"""Batch jobs run by `python -m engine.run job=<name>`: each module has run(cfg)."""
from engine.config import UserError


class JobError(UserError):
    """A job-level problem (bad input file, missing column, ...): reported in one line, exit code 1."""
