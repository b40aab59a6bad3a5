"""Every command the README shows runs in CI, and its tables match the code."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from celery_lease.config import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def commands() -> list[str]:
    return [line.strip() for block in blocks("sh") for line in block.splitlines() if line.strip()]


#: Commands run elsewhere in the suite, exactly as the README shows them.
RUN_ELSEWHERE = {
    "scripts/demo": "tests/test_example.py runs it in a subprocess",
    "scripts/test": ".ci/run runs it (this suite)",
}


def test_readme_commands_are_the_ones_tests_run() -> None:
    found = commands()
    assert "scripts/demo" in found and "scripts/test" in found
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash scripts/test\b", ci, flags=re.M), ci
    assert "scripts/demo" in (ROOT / "tests" / "test_example.py").read_text()
    others = [c for c in found if c not in RUN_ELSEWHERE]
    assert others and all(c.startswith("celery -A example_project lease ") for c in others)


def test_readme_cli_commands_run(installed_venv: Path, tmp_path: Path) -> None:
    """Run each `celery -A example_project lease ...` line from the README, in order."""
    import os

    work = tmp_path / "work"
    shutil.copytree(ROOT / "example_project", work / "example_project")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{installed_venv / 'bin'}:{env.get('PATH', '')}",
        EXAMPLE_DATA=str(tmp_path / "data"),
        PYTHONPATH=str(work),
    )
    for command in commands():
        if command in RUN_ELSEWHERE:
            continue
        out = subprocess.run(
            command.split(), cwd=work, env=env, capture_output=True, text=True, timeout=120
        )
        # 3 is "unknown key / nothing to do": the key has no lease or result yet.
        assert out.returncode in (0, 3), f"{command}: {out.returncode}\n{out.stdout}{out.stderr}"
        assert "Traceback" not in out.stderr, out.stderr


def test_readme_python_blocks_compile() -> None:
    for block in blocks("python"):
        compile(block, "README.md", "exec")


def test_readme_settings_table_lists_every_setting() -> None:
    section = README.split("## Settings", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(lease_\w+)` \|", section, flags=re.M))
    assert listed == set(SETTINGS)


def test_readme_settings_table_shows_every_default() -> None:
    section = README.split("## Settings", 1)[1].split("\n## ", 1)[0]
    shown = dict(re.findall(r"^\| `(lease_\w+)` \| (.*?) \|", section, flags=re.M))
    assert set(shown) <= set(SETTINGS), f"README lists unknown {set(shown) - set(SETTINGS)}"
    for name, setting in SETTINGS.items():
        assert name in shown, f"README's settings table has no row for {name}"
        assert shown[name] == setting.readme_default, name
