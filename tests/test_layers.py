"""The layers: the engine core imports neither Hydra, OmegaConf nor the batch layer (jobs/), and the modules
of engine/, ops/ and jobs/ import one another without a cycle. Imports are read from the source (ast), those
inside functions included, so an import made only when a path runs counts as much as one at the top."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "ops", "jobs")
ENTRY_POINT = "engine.run"  # `python -m engine.run` hands over to jobs.cli: the one arrow from engine/ up


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` (and the outside top-level packages) that the file at `path` imports, anywhere
    in it; `from package import name` counts as package.name when that is a module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known)
    return {name for name in names if name in known or name.split(".")[0] not in PACKAGES} | \
        {name.split(".")[0] for name in names}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: {m for m in imported(path, set(found)) if m in found and m != name} for name, path in found.items()}


def test_the_api_leaves_hydra_omegaconf_and_the_jobs_out():
    code = ("import sys\nfrom engine import LLM, SamplingParams\nLLM, SamplingParams\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'jobs')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_no_engine_module_imports_the_batch_layer():
    """Read from the source: every module of engine/ and ops/ but the entry point, every import in it."""
    found = modules()
    for name, path in found.items():
        if name.split(".")[0] == "jobs" or name == ENTRY_POINT:
            continue
        tops = {m.split(".")[0] for m in imported(path, set(found))}
        assert not tops & {"hydra", "omegaconf", "jobs"}, (name, sorted(tops & {"hydra", "omegaconf", "jobs"}))
    assert imported(found[ENTRY_POINT], set(found)) & set(found) == {"jobs.cli", "jobs"}


def test_the_modules_form_no_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}  # name -> "open" while on the path, "done" once all below it are

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for child in sorted(graph[name]):
            if state.get(child) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(child):] + [child]))
            if child not in state:
                visit(child, path + [child])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check itself: two modules that import each other inside functions are a cycle."""
    package = tmp_path / "jobs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from jobs import b\n")
    (package / "b.py").write_text("def g():\n    import jobs.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert graph["jobs.a"] == {"jobs", "jobs.b"} and graph["jobs.b"] == {"jobs", "jobs.a"}
    with pytest.raises(pytest.fail.Exception, match=r"import cycle: jobs.a -> jobs.b -> jobs.a"):
        test_the_modules_form_no_import_cycle()
