"""The architecture's directions hold: the import contracts in pyproject.toml, and host modules
that import with jax unavailable."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
# import-linter's `lint-imports`, run by this interpreter: where import-linter is installed
# apart from it (the GPU machine's carried wheels, bench/gpu_suite.py) there is no command
# beside sys.executable.
LINT_IMPORTS = [sys.executable, "-c", "import sys; from importlinter.cli import "
                "lint_imports_command; sys.exit(lint_imports_command())", "--no-cache"]


def _lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """The contracts checked on the packages under `cwd` (first on the path: a copy of the
    tree is analysed, not this checkout), import-linter found where this process finds it."""
    import importlinter

    site = pathlib.Path(importlinter.__file__).resolve().parents[1]
    return subprocess.run(LINT_IMPORTS, cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": f"{cwd}:{site}", "PATH": "/usr/bin:/bin"})


def test_import_contracts_are_kept():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_import_contracts_catch_a_host_module_importing_jax(tmp_path):
    """The same contracts on a copy of the tree with one deliberate violation."""
    for name in ("deepinfer_jax", "pallas_kernels", "ascend_backend"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pages = tmp_path / "deepinfer_jax" / "host" / "pages.py"
    pages.write_text(pages.read_text() + "\nimport jax.numpy  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "deepinfer_jax.host is not allowed to import jax" in result.stdout
    assert "deepinfer_jax.host.pages -> jax (l." in result.stdout


def test_no_import_cycles():
    """No module imports, directly or not, a module that imports it back (imports inside
    functions count too): grimp, import-linter's graph library."""
    import grimp

    graph = grimp.build_graph("deepinfer_jax", "pallas_kernels", "ascend_backend", cache_dir=None)
    cycles = [(a, b) for a in sorted(graph.modules)
              for b in sorted(graph.find_modules_directly_imported_by(a))
              if b in graph.modules and graph.chain_exists(importer=b, imported=a)]
    assert cycles == []


def test_host_modules_import_without_jax():
    """Every host module (and the contract and config they use) imports in a process where
    jax, jaxlib and flax cannot be imported."""
    script = textwrap.dedent("""
        import importlib, pkgutil, sys

        class NoJax:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax"):
                    raise ImportError("jax is not importable in this test: " + name)

        sys.meta_path.insert(0, NoJax())
        import deepinfer_jax.host as host
        names = [m.name for m in pkgutil.walk_packages(host.__path__, "deepinfer_jax.host.")]
        names += ["deepinfer_jax.contract", "deepinfer_jax.config.model",
                  "deepinfer_jax.config.engine", "deepinfer_jax.config.hf"]
        for name in names:
            importlib.import_module(name)
        from deepinfer_jax import SamplingParams  # the facade's host names load lazily
        assert not any(m.split(".")[0] in ("jax", "jaxlib", "flax") for m in sys.modules)
        print(len(names))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 12


# Declared packages used without an import statement, and how they are used.
USED_WITHOUT_IMPORT = {
    "pytest-xdist": "make test's -n workers",
    "pytest-timeout": "[tool.pytest.ini_options] timeout",
    "ipykernel": "the kernel nbclient starts for the notebooks",
}
MODULE_OF = {"pytest-xdist": "xdist", "pytest-timeout": "pytest_timeout", "orbax-checkpoint": "orbax",
             "import-linter": "importlinter"}


def test_every_declared_package_is_used():
    """pyproject.toml declares only what the project uses: each dependency is imported by
    the library, its tests, its tools or its notebooks, or listed above with how it is used."""
    import ast
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    names = {re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower() for spec in declared}
    import json

    sources = [path.read_text()
               for folder in ("deepinfer_jax", "pallas_kernels", "ascend_backend", "tests", "tools")
               for path in (ROOT / folder).rglob("*.py")]
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):        # their code cells
        sources += ["".join(cell["source"]) for cell in json.loads(notebook.read_text())["cells"]
                    if cell["cell_type"] == "code"]
    imported = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    unused = {name for name in names - set(USED_WITHOUT_IMPORT)
              if MODULE_OF.get(name, name.replace("-", "_")) not in imported}
    assert unused == set(), f"declared but never imported: {sorted(unused)}"
    assert set(USED_WITHOUT_IMPORT) <= names       # the list names declared packages only
