"""Batch jobs run by `python -m engine.run job=<name>`: each module has run(cfg). Here too what the command
line needs before its heavy imports: the handler of Ctrl-C during start-up."""
import logging
import os

from engine.errors import UserError

STARTUP_INTERRUPTED = "interrupted during start-up: nothing was saved"
log = logging.getLogger("minipaged")


class JobError(UserError):
    """A job-level problem (bad input file, missing column, ...): reported in one line, exit code 1."""


def first_line(err: Exception) -> str:
    """The first line of an exception's message (its type's name when empty), for one-line reports."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def log_to_files(level: int, message: str) -> None:
    """Write `message` to the log files (Hydra's <run dir>/run.log, once it has set up logging), not to
    the console: there, the error line says it once."""
    record = log.makeRecord(log.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def exit_interrupted_at_start_up(signum, frame) -> None:
    """SIGINT's handler from engine/run.py's first line until jobs/cli.py's run_job starts the job: the line
    `error: STARTUP_INTERRUPTED` (in run.log too, once there is one) and exit 130, at once, as nothing has
    started that could save anything. A KeyboardInterrupt raised there instead did not always get that far:
    inside an import, numpy's C extension swallowed it (the job then ran to its end) or left numpy half
    imported (an AttributeError's traceback later), and between the handlers around the imports and main it
    ended the process with a traceback (exit -2)."""
    log_to_files(logging.ERROR, STARTUP_INTERRUPTED)
    os.write(2, f"error: {STARTUP_INTERRUPTED}\n".encode())
    os._exit(130)
