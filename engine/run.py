"""`python -m engine.run job=<name> [overrides]`: the command line of the batch layer (jobs/cli.py), kept
under the engine's name. The one import from engine/ into jobs/: the core itself never imports the batch
layer (tests/test_layers.py checks both)."""
from jobs.cli import main

if __name__ == "__main__":
    main()
