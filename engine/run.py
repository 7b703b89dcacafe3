"""Entry point: `python -m engine.run job=<name> [overrides]` runs jobs/<name>.py in Hydra's run directory."""
import importlib
import logging
import sys

import hydra
from omegaconf import DictConfig

from engine.config import ConfigError, register_configs, validate
from jobs import JobError

log = logging.getLogger("minipaged")
register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
        importlib.import_module(f"jobs.{cfg.job.name}").run(cfg)
    except (ConfigError, JobError) as err:  # a problem of the input or the settings: one line, no traceback
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 1))


if __name__ == "__main__":
    main()
