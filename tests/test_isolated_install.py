"""Each package installs alone, with only its declared dependencies, and its README example runs.

`uv sync --package NAME` into a fresh environment installs exactly that package and what its
pyproject declares (versions from uv.lock); the README's ```python blocks then run there.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if p.is_dir())


def readme_example(package: str) -> str:
    """The README's ```python blocks, concatenated: they form one runnable example."""
    text = (ROOT / "packages" / package / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    assert blocks, f"packages/{package}/README.md has no ```python example"
    return "\n".join(blocks)


def _uv() -> str:
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists():
        pytest.fail("uv is not installed; tools/run-tests installs it")
    return uv


@pytest.mark.parametrize("package", PACKAGES)
def test_package_installs_alone_and_its_readme_example_runs(package, tmp_path):
    env_dir = tmp_path / "venv"
    env = dict(os.environ, UV_PROJECT_ENVIRONMENT=str(env_dir))
    env.pop("VIRTUAL_ENV", None)
    subprocess.run(
        [_uv(), "sync", "--frozen", "--no-dev", "--package", package, "--quiet"],
        cwd=ROOT, env=env, check=True, timeout=600,
    )
    python = env_dir / "bin" / "python"
    module = package.replace("-", "_")
    listed = subprocess.run([_uv(), "pip", "list", "--python", str(python)], env=env,
                            capture_output=True, text=True, check=True).stdout
    assert "transformers" not in listed, f"{package} pulled transformers into its environment"
    script = tmp_path / "example.py"
    script.write_text(f"import {module}\nprint({module}.__version__)\n" + readme_example(package))
    run_env = dict(env, OMP_NUM_THREADS="1", PYTHONPATH="")
    result = subprocess.run([str(python), str(script)], cwd=tmp_path, env=run_env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"README example of {package} failed:\n{result.stdout}\n{result.stderr}"
