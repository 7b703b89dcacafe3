"""Batch jobs run by `python -m engine.run job=<name>`: each module has run(cfg)."""


class JobError(Exception):
    """A job-level problem (bad input file, missing column, ...): reported in one line, exit code 1."""
