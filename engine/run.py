"""`python -m engine.run job=<name> [overrides]`: the command line of the batch layer (jobs/cli.py), kept
under the engine's name. The one import from engine/ into jobs/: the core itself never imports the batch
layer (tests/test_layers.py checks both). From its first line until the job starts, Ctrl-C exits at once
with one line (jobs.exit_interrupted_at_start_up)."""
import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # held back until its handler is in place
from jobs import exit_interrupted_at_start_up  # noqa: E402

signal.signal(signal.SIGINT, exit_interrupted_at_start_up)  # before jobs.cli's imports: they are start-up too
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
from jobs.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
