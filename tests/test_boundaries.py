"""Package boundaries: each package imports only what the design allows and what it declares.

The same rule as DEVELOPERS.md's table (and ../shared/tools/check_boundaries.py), kept here
so CI enforces it on a clean clone; plus the converse: a package declares only what it imports.
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"

# Which project packages each package may import (distribution names).
ALLOWED = {
    "titan-models": set(),
    "flexshard": set(),
    "torch-checkpointing": set(),
    "dist-moe": set(),
    "titan-rl": {"titan-models"},
    "titan-train": {"titan-models", "flexshard", "torch-checkpointing", "dist-moe", "titan-rl"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _requirement_name(spec: str) -> str:
    return re.split(r"[\s\[<>=!~;]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared(pyproject: dict) -> tuple[set[str], set[str]]:
    """(required, optional-extra) distribution names."""
    project = pyproject["project"]
    required = {_requirement_name(d) for d in project.get("dependencies", [])}
    optional = {_requirement_name(d) for deps in project.get("optional-dependencies", {}).values() for d in deps}
    return required, optional


def _module_owners() -> dict[str, str]:
    owners = {}
    for pkg in PACKAGES.iterdir():
        for mod in (pkg / "src").iterdir():
            if (mod / "__init__.py").exists():
                owners[mod.name] = pkg.name
    return owners


def test_the_six_packages_exist():
    assert sorted(p.name for p in PACKAGES.iterdir() if p.is_dir()) == sorted(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_rules_and_are_declared(package):
    pkg = PACKAGES / package
    pyproject = tomllib.loads((pkg / "pyproject.toml").read_text())
    required, optional = _declared(pyproject)
    owners = _module_owners()
    third_party = {mod: {d.lower().replace("_", "-") for d in dists} for mod, dists in packages_distributions().items()}
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    problems, imported = [], set()
    for path in sorted((pkg / "src").rglob("*.py")):
        for mod in _imports(path):
            rel = path.relative_to(ROOT)
            if mod in stdlib or owners.get(mod) == package:
                continue
            if mod in owners:
                dist = owners[mod]
                if dist not in ALLOWED[package]:
                    problems.append(f"{rel}: imports {mod} ({dist}); {package} may not depend on {dist}")
            else:
                dists = third_party.get(mod)
                if dists:
                    dist = sorted(dists)[0]
                else:  # not installed here (an optional extra such as vllm): match by name
                    dist = mod.lower().replace("_", "-")
            imported.add(dist)
            if dist not in required | optional:
                problems.append(f"{rel}: imports {mod} ({dist}) but {package}/pyproject.toml does not declare it")
    # The converse: every required dependency is imported somewhere (torch's triton aside).
    for dist in sorted(required - imported):
        problems.append(f"{package} declares {dist} but never imports it")
    assert not problems, "\n".join(problems)


def test_transformers_is_never_a_runtime_dependency():
    for package in ALLOWED:
        pyproject = tomllib.loads((PACKAGES / package / "pyproject.toml").read_text())
        required, optional = _declared(pyproject)
        assert "transformers" not in required | optional, package


def test_version_lives_in_one_place():
    for package, owner in ((p, m) for m, p in _module_owners().items()):
        pyproject = (PACKAGES / package / "pyproject.toml").read_text()
        assert 'dynamic = ["version"]' in pyproject, package
        init = (PACKAGES / package / "src" / owner / "__init__.py").read_text()
        assert re.search(r'^__version__ = "\d+\.\d+\.\d+', init, re.M), package
        assert (PACKAGES / package / "CHANGELOG.md").exists(), package
        assert (PACKAGES / package / "README.md").exists(), package
