"""Build celery-lease's wheel and install it in fresh virtualenvs, as a user would.

For the packaging tests (``@pytest.mark.packaging``): what they see is the
wheel's contents and the dependencies its metadata names, never the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What the source copy leaves out: nothing of it may reach the wheel by accident.
IGNORED = (
    ".venv",
    ".git",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    "build",
    "dist",
    "site",
    ".example-data",
    "tests",
)


def build_wheel(base: Path) -> Path:
    """``pip wheel --no-deps`` from a copy of the source tree; the wheel's path."""
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*IGNORED))
    out = base / "wheelhouse"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shutil.rmtree(src)
    (wheel,) = out.glob("celery_lease-*.whl")
    return wheel


def clean_env(venv: Path) -> dict[str, str]:
    """The environment a user's shell would have with ``venv`` activated."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_REQUIRE"))
    }
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def fresh_venv(venv: Path, *requirements: str) -> Path:
    """A new virtualenv with ``pip install REQUIREMENTS...`` run in it; the venv."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    result = pip(venv, "install", "-q", *requirements, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return venv


def pip(venv: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(venv),
        cwd=venv,
    )
