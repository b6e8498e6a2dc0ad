"""Runs the model-facing tests (``-m models``) again under TransformerLens 3.x ``HookedTransformer``.

The main suite runs on TransformerLens 4.x (``TransformerBridge``). This test builds (once, cached
in ``.venv-tl3`` at the repository root, and again whenever ``pyproject.toml`` changes) a second environment with ``transformer-lens>=3,<4`` and the
same sinklens checkout, and runs every test marked ``models`` there, so analyzers and interventions
are checked against both model classes in one ``pytest`` call.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-tl3"


def _python() -> Path:
    return VENV / "bin" / "python"


def _ensure_tl3_env() -> None:
    """The environment, installed again when ``pyproject.toml`` changed since it was built (a new test dependency,
    e.g. pytest-xdist for the ``addopts``, would otherwise be missing from it)."""
    marker = VENV / ".sinklens-ready"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if marker.is_file() and marker.read_text().strip() == wanted:
        return
    if not _python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "torch==2.13.0", "transformer-lens>=3,<4", "-e", f"{ROOT}[test]"], check=True)
    marker.write_text(wanted)


@pytest.mark.slow
def test_model_facing_tests_pass_on_transformer_lens_3():
    _ensure_tl3_env()
    version = subprocess.run(
        [str(_python()), "-c", "import importlib.metadata as m; print(m.version('transformer-lens'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert version.startswith("3."), f"expected TransformerLens 3.x in {VENV}, found {version}"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run(
        [str(_python()), "-m", "pytest", "-q", "-m", "models", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"TransformerLens {version}: {summary}")
    assert done.returncode == 0, f"model-facing tests failed on TransformerLens {version}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in summary and "no tests ran" not in summary, summary
