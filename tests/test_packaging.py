"""A plain `pip install .` (not editable) gives a package that runs: conf/ and the sample prompts ship as package
data, and the console script `minipaged` is engine.run:main. The wheel is built offline (no build isolation:
this interpreter's setuptools) from a copy of the source tree, into a --target directory; the job then runs from
another directory with `python -S` (no site, so not the editable install's finder) and PYTHONPATH = the target,
then this interpreter's site-packages, so that nothing can come from the checkout."""
import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
NOT_BUILT = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
                                   "outputs", "multirun", "tests", "benchmarks", "docs")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The package installed by `pip install --no-deps --no-build-isolation --no-index <copy> --target <here>`."""
    source, target = tmp_path_factory.mktemp("source") / "minipaged", tmp_path_factory.mktemp("target")
    shutil.copytree(ROOT, source, ignore=NOT_BUILT)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                             "--no-index", str(source), "--target", str(target)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return target


def installed_env(target: Path) -> dict:
    """PYTHONPATH: the target, then this interpreter's site-packages and the PYTHONPATH it was given (where a
    machine keeps packages installed with --target), the checkout left out."""
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    site_packages = dict.fromkeys([*(sysconfig.get_paths()[k] for k in ("purelib", "platlib")), *given])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *site_packages]), "TQDM_DISABLE": "1"}


def test_the_installed_job_runs_from_another_directory(target, tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-S", "-m", "engine.run", "sampling.max_tokens=2", "model.device=cpu",
                             f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, env=installed_env(target), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    sample_rows = pq.read_metadata(ROOT / "jobs" / "sample_prompts.parquet").num_rows  # the shipped sample: no job.input
    assert pq.read_table(run_dir / "generations.parquet").num_rows == sample_rows
    sources = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.config_sources
    assert str(target / "conf") in [s.path for s in sources]  # engine/../conf of the installed engine


def test_the_console_script_is_engine_run_main(target, tmp_path):
    distribution = next(importlib.metadata.distributions(name="minipaged", path=[str(target)]))
    scripts = {e.name: e.value for e in distribution.entry_points if e.group == "console_scripts"}
    assert scripts == {"minipaged": "engine.run:main"}
    result = subprocess.run([sys.executable, "-S", str(target / "bin" / "minipaged"), "--help"], cwd=tmp_path,
                            env=installed_env(target), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "model=qwen3-0.6b" in result.stdout and "job=analyze" in result.stdout  # the installed conf/'s groups
