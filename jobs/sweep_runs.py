"""The runs of a sweep: found below a directory, their summaries read and combined into one table, and
the config keys the sweep varied.

Every summary.parquet below the root is one run (read with pyarrow.dataset). A run whose summary is
missing, unreadable, foreign (no MiniPaged schema version) or lacks the columns compared here is
skipped, with the reason. Runs written by older schema versions are read with their columns renamed to
today's names; columns missing from some runs are null there. The swept keys are the config keys (from
each file's metadata) whose values differ between the runs, ordered as they appear in the runs' Hydra
overrides.
"""
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from jobs import JobError, first_line
from jobs.parquet import SCHEMA_VERSIONS, flatten, schema_config, schema_version

log = logging.getLogger("minipaged")
REQUIRED = ("block_size", "num_blocks", "output_tok_per_s", "mean_paged_kv_utilization_pct", "mean_internal_waste_pct")
RENAMED = {"1": {"mean_contiguous_kv_utilization_pct": "contiguous_kv_utilization_pct"}}  # old name -> today's
NOT_RUNS = ("analyze",)  # Hydra run directories of these jobs hold no run to compare
SWEPT_META = b"minipaged.swept_keys"


def find_runs(root: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """summary.parquet files below root, and run directories that have none (with the reason)."""
    summaries = sorted(root.rglob("summary.parquet"))
    have = {p.parent for p in summaries}
    candidates = {p.parent for p in root.rglob(".hydra") if p.is_dir()}
    candidates |= {p.parent for name in ("steps.parquet", "generations.parquet") for p in root.rglob(name)}
    missing = []
    for run in sorted(candidates - have):
        try:
            job_name = OmegaConf.load(run / ".hydra" / "config.yaml").job.name
        except Exception:  # no or unreadable Hydra config: judge by the files alone
            job_name = None
        if job_name not in NOT_RUNS:
            missing.append((run, "no summary.parquet (the run failed or has not finished)"))
    return summaries, missing


def check_schema(path: Path) -> tuple[pa.Schema | None, str | None]:
    """The file's schema, or None and why the file is not a summary we can compare."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as err:
        return None, f"not a readable Parquet file ({first_line(err)})"
    version = schema_version(schema)
    if version is None:
        return None, "foreign file: no minipaged.schema_version in its metadata"
    if version not in SCHEMA_VERSIONS:
        return None, f"schema version {version} is unknown to this reader (knows {', '.join(SCHEMA_VERSIONS)})"
    names = set(schema.names) | {new for old, new in RENAMED.get(version, {}).items() if old in schema.names}
    lacking = [c for c in REQUIRED if c not in names]
    if lacking:
        return None, f"not a run summary: no column {', '.join(lacking)}"
    return schema, None


def read_summaries(paths: list[Path]) -> tuple[list[tuple[Path, dict, pa.Table]], list[tuple[Path, str]]]:
    """(summary path, flat config, one-row table) per usable run, and (path, reason) per skipped one."""
    good, skipped = [], []
    checked = []
    for path in paths:
        schema, reason = check_schema(path)
        if reason:
            skipped.append((path.parent, reason))
        else:
            checked.append((path, schema))
    if not checked:
        return good, skipped
    dataset = ds.dataset([str(p) for p, _ in checked], format="parquet", schema=checked[0][1].remove_metadata())
    fragments = {Path(f.path): f for f in dataset.get_fragments()}
    for path, schema in checked:
        try:
            fragment = fragments[Path(str(path))]
            table = fragment.to_table(schema=fragment.physical_schema)
        except (pa.ArrowException, OSError) as err:
            skipped.append((path.parent, f"unreadable ({first_line(err)})"))
            continue
        if table.num_rows != 1:
            skipped.append((path.parent, f"expected one row, found {table.num_rows}"))
            continue
        renames = RENAMED.get(schema_version(schema), {})
        table = table.rename_columns([renames.get(n, n) for n in table.column_names]).replace_schema_metadata(None)
        try:
            config = flatten(schema_config(schema))
        except ValueError:  # metadata that is not JSON: compare the run without its config
            config = {}
        good.append((path, config, table))
    return good, skipped


def combine(good: list[tuple[Path, dict, pa.Table]]) -> tuple[list, pa.Table, list[tuple[Path, str]]]:
    """Concatenate the one-row tables (columns missing somewhere are null there, numeric types widened);
    a run whose column types clash with the runs before it is skipped."""
    try:
        return good, pa.concat_tables([t for _, _, t in good], promote_options="permissive"), []
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    kept, table, skipped = [], None, []
    for entry in good:
        try:
            merged = entry[2] if table is None else pa.concat_tables([table, entry[2]], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            skipped.append((entry[0].parent, f"column types clash with the other runs ({first_line(err)})"))
            continue
        kept.append(entry)
        table = merged
    return kept, table, skipped


def override_keys(run: Path) -> list[str]:
    """The keys of the run's Hydra overrides, in the order given (empty when there is no record). The overrides
    are the command line's text: one that reads like an interpolation (`${...}`) is not resolved."""
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(run / ".hydra" / "overrides.yaml"), resolve=False)
    except Exception:
        return []
    return [str(o).split("=", 1)[0].lstrip("+~") for o in overrides] if isinstance(overrides, list) else []


def swept_keys(configs: list[dict], runs: list[Path]) -> list[str]:
    """Config keys (present in every run's config) whose values differ between runs, in override order."""
    with_config = [c for c in configs if c]
    if len(with_config) < 2:
        return []
    common = set.intersection(*(set(c) for c in with_config))
    swept = [k for k in common if len({json.dumps(c[k], sort_keys=True) for c in with_config}) > 1]
    order = []
    for run in runs:
        order += [k for k in override_keys(run) if k not in order]

    def position(key: str) -> tuple:
        hits = [i for i, k in enumerate(order) if key == k or key.startswith(k + ".")]
        return (min(hits) if hits else len(order), key)

    return sorted(swept, key=position)


def shown_keys(swept: list[str]) -> list[str]:
    """The swept keys worth a column or a label: a whole group swept (model=a,b) shows as its name."""
    groups = {k.rsplit(".", 1)[0] for k in swept if k.endswith(".name") and "." in k}
    return [k for k in swept if k.rsplit(".", 1)[0] not in groups or k.endswith(".name")]


def cell(value):
    """A config value as a sweep.parquet cell: scalars as they are, lists and dicts as JSON."""
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def sort_key(value) -> tuple:
    if value is None:
        return (2, "")
    if isinstance(value, (bool, int, float)):
        return (0, float(value))
    return (1, str(value))


def build_sweep(root: Path, good: list, table: pa.Table, swept: list[str]) -> pa.Table:
    rows = table.to_pylist()
    runs = [p.parent.relative_to(root).as_posix() for p, _, _ in good]
    values = [{k: cell(config.get(k)) for k in swept} for _, config, _ in good]
    order = sorted(range(len(rows)), key=lambda i: ([sort_key(values[i][k]) for k in swept], runs[i]))
    columns = {"run": pa.array([runs[i] for i in order], pa.string())}
    for key in swept:
        column = [values[i][key] for i in order]
        try:
            columns[key] = pa.array(column)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # mixed kinds, or ints past int64 (a
            # 64-bit seed over 2^63): keep them as text
            columns[key] = pa.array([None if v is None else str(v) for v in column], pa.string())
    sweep = pa.table(columns)
    ordered = table.take(order)
    for name in ordered.column_names:
        if name not in columns:
            sweep = sweep.append_column(ordered.schema.field(name), ordered[name])
    return sweep.replace_schema_metadata({SWEPT_META: json.dumps(swept).encode()})


def read_sweep(root: Path) -> tuple[pa.Table, list[str], list[tuple[Path, str]]]:
    """The runs below root as one table (build_sweep), their swept keys, and the skipped runs with their
    reasons (logged as warnings); JobError if no run is usable."""
    summaries, skipped = find_runs(root)
    good, unusable = read_summaries(summaries)
    good, table, clashing = combine(good) if good else ([], None, [])
    skipped = sorted(skipped + unusable + clashing)
    for run, reason in skipped:
        log.warning("skipped %s: %s", run.relative_to(root).as_posix(), reason)
    if not good:
        raise JobError(f"job.root: no usable summary.parquet below {root} ({len(skipped)} runs skipped)")
    swept = swept_keys([c for _, c, _ in good], [p.parent for p, _, _ in good])
    return build_sweep(root, good, table, swept), swept, skipped
