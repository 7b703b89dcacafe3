"""The command line, `python -m engine.run job=<name> [overrides]` (engine/run.py hands over to main here):
Hydra composes the config and runs the job in Hydra's run directory.

A problem of the input or the settings (engine.errors.UserError, which the jobs' JobError is) prints one
line, `error: ...`, and exits with its exit code; so does Ctrl-C outside a job's own handling of it (exit
130). The overrides are checked against the schemas before Hydra composes them, so that an unknown key or
a value of the wrong type gets our message (the closest key, the key's type) rather than Hydra's.
"""
import logging
import sys

from jobs import STARTUP_INTERRUPTED, log_to_files

log = logging.getLogger("minipaged")


def fail(message: str, exit_code: int):
    """Print `message` as one error line and exit; the run's log file (run.log) gets the line too."""
    log_to_files(logging.ERROR, message)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


try:  # Ctrl-C while Python imports Hydra is start-up too (under engine/run.py, its handler exits at once)
    import atexit
    import dataclasses
    import gc
    import json
    import os
    import signal
    import typing

    import hydra
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Override, Transformer
    from hydra.errors import OverrideParseException
    from omegaconf import OmegaConf, ValidationError
    from omegaconf.errors import InterpolationResolutionError

    from engine.config import CONF_DIR, default_options, sampling_params
    from engine.errors import ConfigError, UserError
    from jobs.config import Config, key_field, key_help, register_configs, validate
except KeyboardInterrupt:
    fail(STARTUP_INTERRUPTED, 130)

GROUPS = [f.name for f in dataclasses.fields(Config)]  # conf/<group>/*.yaml: model, cache, scheduler, sampling, job
KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}
NEWLINE_STOP = """$'sampling.stop=["\\n\\n"]'"""  # a stop string of two newlines, as the shell is given it


def group_options(group: str) -> dict[str, str]:
    """conf/<group>/<option>.yaml -> the comment that opens the file (its lines up to the first that is not
    a comment), on one line."""
    return {file.stem: opening_comment(file.read_text()) for file in sorted((CONF_DIR / group).glob("*.yaml"))}


def opening_comment(text: str) -> str:
    """The comment lines that open a YAML file's `text`, joined with spaces: whole sentences, where the
    first line alone may stop mid-sentence."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(line for line in lines if line)


def _values(override: Override) -> list:
    """The value(s) an override sets: one, or each of a sweep's (none for a sweep we cannot list), as Hydra
    gives a run of the sweep each: its text parsed again as one override's value (a sweep of lists is lists)."""
    if not override.is_sweep_override():
        return [override.value()]
    if not override.is_discrete_sweep():
        return []
    parser = OverridesParser.create()
    return [parser.parse_override(f"v={text}").value() for text in override.sweep_iterator(Transformer.encode)]


def _kind(annotation) -> str:
    args = typing.get_args(annotation)
    if type(None) in args:
        return f"{_kind(next(a for a in args if a is not type(None)))} or null"
    return "a list such as [1, 2]" if typing.get_origin(annotation) is list else KINDS.get(annotation, str(annotation))


def _is_bool(annotation) -> bool:
    return annotation is bool or set(typing.get_args(annotation)) == {bool, type(None)}


def check_overrides(args: list[str]) -> None:
    """ConfigError for what Hydra would reject in these command-line overrides: an unknown key (with the
    closest known one, as key=value and as +key=value alike), a known key appended with +, a value of the
    wrong type (a number for true or false too, which OmegaConf would take), an option that a config group does
    not have, a key removed (~) or a group placed elsewhere (@); one that does not parse (named, on one line)."""
    try:
        overrides = OverridesParser.create().parse_overrides(get_args_parser().parse_known_args(args)[0].overrides)
    except OverrideParseException as err:
        raise ConfigError(f"cannot parse the override {err.override!r}: {err.message.splitlines()[0]} (quote a value "
                          f"that holds brackets, commas, quotes or spaces: Hydra's override grammar)") from None
    jobs = next((_values(o) for o in overrides if o.key_or_group == "job"), [default_options()["job"]])
    for override in overrides:
        key = override.key_or_group
        if override.is_hydra_override():
            continue
        if override.is_delete() or override.package is not None:
            raise ConfigError(f"{override.input_line or key}: removing a key (~) or placing a config group elsewhere "
                              f"(@) is not supported; set the key's value instead")
        if key in GROUPS:
            unknown = [v for v in _values(override) if v not in group_options(key)]
            if unknown:
                raise ConfigError(f"{key}: no option {unknown[0]!r}; options: {', '.join(group_options(key))}")
            continue
        for job in jobs:
            owner, field = key_field(key, job)
            if override.is_add():
                raise ConfigError(f"{key} is a known key: set it without the +, as {key}=...")
            for value in _values(override):
                if _is_bool(field.type) and isinstance(value, (int, float)) and not isinstance(value, bool):
                    raise ConfigError(f"{key} must be {_kind(field.type)}, got {value!r}")  # OmegaConf takes 2 as true
                try:
                    setattr(OmegaConf.structured(owner), field.name, value)  # OmegaConf's conversions, as Hydra's
                except ValidationError:
                    raise ConfigError(f"{key} must be {_kind(field.type)}, got {value!r}") from None


def check_sweep(args: list[str]) -> None:
    """With --multirun, every run's configuration checked (validate) before the first runs, so that a bad
    value in the third run of a sweep stops it before the first two run; ConfigError naming the run."""
    parsed = get_args_parser().parse_known_args(args)[0]
    if not parsed.multirun:
        return
    try:
        runs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(parsed.overrides), None)[0]
    except OverrideParseException:
        return  # check_overrides, which runs first, reports it
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for number, overrides in enumerate(runs):
            own = [o for o in overrides if not o.startswith("hydra.")]
            try:
                validate(compose("config", overrides=own))
            except ConfigError as err:
                raise ConfigError(f"sweep run #{number} ({' '.join(own)}): {err}") from None


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def help_text(cfg) -> str:
    """The generated part of `--help`: the options of each config group that has several (with the first
    line of their YAML's comment), then every key of the composed config with its value and the comment
    beside its field in engine/config.py. `job=bench --help` lists bench's keys."""
    chosen = OmegaConf.select(cfg, "hydra.runtime.choices", default={})
    options = [(f"{group}={name}", text + ("  (chosen)" if chosen.get(group) == name else ""))
               for group in sorted(GROUPS, key=lambda g: g != "job") if len(group_options(group)) > 1
               for name, text in group_options(group).items()]
    sections = []
    for group in GROUPS:
        described = key_help(OmegaConf.get_type(cfg[group]))
        values = OmegaConf.to_container(cfg[group], resolve=False)
        sections.append([(f"{group}.{key}={_text(value)}", described[key]) for key, value in values.items()
                         if (group, key) != ("job", "name")])  # job=NAME sets it
    width = min(40, max(len(setting) for setting, _ in options + sum(sections, [])))

    def rows(pairs: list[tuple[str, str]]) -> str:
        return "\n".join(f"  {setting:<{width}}  {text}".rstrip() for setting, text in pairs)

    blocks = [f"Config groups (GROUP=NAME):\n{rows(options)}",
              f"Keys (KEY=VALUE), with the values of this configuration:\n{rows(sections[0])}", *map(rows, sections[1:])]
    return "\n\n".join(blocks).replace("$", "$$")  # Hydra's help template is a string.Template


register_configs()
OmegaConf.register_new_resolver("minipaged_help", lambda *, _root_: help_text(_root_), replace=True)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def run_job(cfg) -> None:
    """Hydra's task. Errors are reported here: Hydra prints a traceback for any exception its task raises."""
    started = False
    try:
        validate(cfg)
        job = job_module(cfg.job.name)
        log_start(cfg, job)
        warn_escaped_newlines(cfg.sampling)
        started = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the job handles Ctrl-C itself (saving its rows)
        job.run(cfg)
    except UserError as err:
        fail(str(err), err.exit_code)
    except InterpolationResolutionError as err:  # ${oc.env:NAME} unset, ${a.key} that does not exist
        where = f"{err.full_key}: " if err.full_key else ""  # none outside the job's config
        fail(f"{where}{str(err.msg or err).splitlines()[0]}", ConfigError.exit_code)
    except KeyboardInterrupt:  # a job that saves results handles Ctrl-C itself and raises a UserError
        fail(f"interrupted: job={cfg.job.name} stopped before it finished" if started else STARTUP_INTERRUPTED, 130)


def job_module(name: str):
    """The module of job=`name` (its run(cfg)), imported only when that job runs: a bench needs no Parquet
    reader, and --help none of them."""
    if name == "generate":
        from jobs import generate as job
    elif name == "bench":
        from jobs import bench as job
    else:
        from jobs import analyze as job
    return job


def log_start(cfg, job) -> None:
    """What the run computes from, first in its log: the model and, for a job that reads one, the input."""
    log.info("job=%s: %s", cfg.job.name, f"model.path={cfg.model.path}" if cfg.model.path else
             f"model={cfg.model.name}, random weights (model.path is null)")
    if "input" in cfg.job:
        log.info("input: %s", cfg.job.input if cfg.job.input is not None else
                 f"{job.SAMPLE_INPUT} (job.input is null: the shipped sample)")


def warn_escaped_newlines(sampling_cfg) -> None:
    """Warn about stop strings that hold a backslash followed by an n: from a command line, nearly always a
    newline meant (Hydra keeps quoted text as it is, unlike Python or JSON). The string is kept as given,
    as a backslash can be meant (LaTeX's \\newline)."""
    escaped = [stop for stop in sampling_params(sampling_cfg).stop if "\\n" in stop]
    if escaped:
        log.warning("sampling.stop %s holds a backslash and an n, not a newline; to pass a newline, let the shell "
                    "write one, e.g. %s in bash or zsh", ", ".join(f"'{stop}'" for stop in escaped), NEWLINE_STOP)


def main() -> None:
    atexit.unregister(quiet_teardown)  # once per process, however often main runs in it
    atexit.register(quiet_teardown)
    try:
        check_overrides(sys.argv[1:])
        check_sweep(sys.argv[1:])
        run_job()
    except UserError as err:
        fail(str(err), err.exit_code)
    except KeyboardInterrupt:
        fail(STARTUP_INTERRUPTED, 130)
    except BrokenPipeError:  # `--help | head`: the reader has gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    finally:
        # The interpreter's exit runs full garbage collections over every object that torch, transformers
        # and the rest made (~170,000: 0.12 s a collection on a 2-core VM, and the exit runs several), 0.5 s
        # of a tiny job's 0.7 s exit, for nothing: the work is done and its files are closed. Frozen objects
        # are out of the collector's reach; atexit handlers still run, and the OS takes the memory back.
        gc.freeze()


def quiet_teardown() -> None:
    """The console's last line is the job's: frozen objects are never freed, so a module built with nanobind
    (Triton 3.9's libtriton) would list each object of its own still alive as leaked, ~30 lines, when the
    interpreter tears it down after the atexit handlers. Registered as main starts, this runs after the
    handlers that the job registers (atexit runs the last registered first)."""
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stderr.fileno())
    os.close(devnull)


if __name__ == "__main__":
    main()
