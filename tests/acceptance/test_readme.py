"""Every command the README and the docs show runs in CI, and the settings table matches the code.

- README: ``scripts/demo`` and ``scripts/test`` run elsewhere; its other lines
  are the Getting started page's, which ``test_getting_started_as_written``
  runs from the built wheel in a fresh virtualenv, to an accepted result.
- docs/operations.md: each ``celery -A proj lease ...`` line, against the
  example project, from a non-editable install.
- docs/settings.md: one row per ``lease_*`` setting, with its default.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from celery_lease.config import SETTINGS
from tests.servers import wait_for
from tests.wheel_venv import build_wheel, clean_env, fresh_venv

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
GETTING_STARTED = (ROOT / "docs" / "getting-started.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
SETTINGS_PAGE = (ROOT / "docs" / "settings.md").read_text()


def blocks(text: str, lang: str) -> list[str]:
    """The page's ``lang`` fences, dedented: a fence inside a list item is indented."""
    return [textwrap.dedent(b) for b in re.findall(rf"```{lang}[^\n]*\n(.*?)```", text, flags=re.S)]


def commands(text: str) -> list[str]:
    return [
        line.split("  #", 1)[0].strip()
        for block in blocks(text, "sh")
        for line in block.splitlines()
        if line.strip()
    ]


def files(text: str) -> dict[str, str]:
    """The ``python title="name.py"`` blocks of a page, by file name."""
    return dict(re.findall(r'```python title="([\w.]+)"\n(.*?)```', text, flags=re.S))


#: Commands run elsewhere in the suite, exactly as the README shows them.
RUN_ELSEWHERE = {
    "scripts/demo": "tests/acceptance/test_example.py runs it in a subprocess",
    "scripts/test": ".ci/run runs it (this suite)",
}


def test_readme_commands_are_the_ones_tests_run() -> None:
    found = commands(README)
    assert "scripts/demo" in found and "scripts/test" in found
    ci = (ROOT / ".ci" / "run").read_text()
    # exactly the README's command: no pytest arguments (those make it another run)
    assert re.search(r"^bash scripts/test( \|\||$)", ci, flags=re.M), ci
    assert "scripts/demo" in (ROOT / "tests" / "acceptance" / "test_example.py").read_text()
    others = [c for c in found if c not in RUN_ELSEWHERE]
    started = commands(GETTING_STARTED)
    assert others and all(c in started for c in others), (others, started)


def test_readme_example_is_the_getting_started_app() -> None:
    """The README's app is the page's ``proj.py``, so the walk-through test runs it."""
    (readme_app,) = [b for b in blocks(README, "python") if "LeasedTask" in b]
    assert readme_app.startswith("# proj.py\n"), readme_app
    assert readme_app.removeprefix("# proj.py\n") == files(GETTING_STARTED)["proj.py"]


def test_python_blocks_compile() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for block in blocks(page.read_text(), "python"):
            compile(block, str(page.relative_to(ROOT)), "exec")


@pytest.mark.packaging  # a fresh virtualenv: .ci/run's long runs (-m ci)
@pytest.mark.slow
@pytest.mark.ci
def test_operations_cli_commands_run(installed_venv: Path, tmp_path: Path) -> None:
    """Run each `celery -A proj lease ...` line of docs/operations.md, in order."""
    work = tmp_path / "work"
    shutil.copytree(ROOT / "example_project", work / "example_project")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{installed_venv / 'bin'}:{env.get('PATH', '')}",
        EXAMPLE_DATA=str(tmp_path / "data"),
        PYTHONPATH=str(work),
    )
    lines = commands(OPERATIONS)
    assert lines and all(c.startswith("celery -A proj lease ") for c in lines), lines
    for command in lines:
        argv = command.replace("-A proj", "-A example_project").split()
        out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=120)
        # 3 is "unknown key / nothing to do": the key has no lease or result yet.
        assert out.returncode in (0, 3), f"{command}: {out.returncode}\n{out.stdout}{out.stderr}"
        assert "Traceback" not in out.stderr, out.stderr


def settings_rows() -> dict[str, str]:
    section = SETTINGS_PAGE.split("## Settings", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(lease_\w+)` \| (.*?) \|", section, flags=re.M))


def test_settings_page_lists_every_setting() -> None:
    assert set(settings_rows()) == set(SETTINGS)


def test_settings_page_shows_every_default() -> None:
    shown = settings_rows()
    assert set(shown) <= set(SETTINGS), f"the page lists unknown {set(shown) - set(SETTINGS)}"
    for name, setting in SETTINGS.items():
        assert name in shown, f"docs/settings.md has no row for {name}"
        assert shown[name] == setting.readme_default, name


@pytest.mark.packaging  # a fresh virtualenv: .ci/run's long runs (-m ci)
@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.timeout(1500)
def test_getting_started_as_written(tmp_path: Path, make_redis_server: object, pg_url: str) -> None:
    """docs/getting-started.md, line by line, from the wheel in a fresh virtualenv.

    Only the servers' addresses change: the page's Redis and PostgreSQL URLs
    become private servers'. The worker command runs in the background.
    """
    redis = make_redis_server()  # type: ignore[operator]
    base = redis.url(0)[: -len("0")]

    def localise(code: str) -> str:
        return code.replace("redis://127.0.0.1:6379/", base).replace(
            "postgresql+psycopg://127.0.0.1/proj", pg_url
        )

    lines = commands(GETTING_STARTED)
    assert lines[0] == 'pip install "celery-lease[redis,postgres]"', lines
    wheel = build_wheel(tmp_path / "build")
    venv = fresh_venv(tmp_path / "venv", f"celery-lease[redis,postgres] @ {wheel.as_uri()}")

    work = tmp_path / "proj"
    work.mkdir()
    for name, code in files(GETTING_STARTED).items():
        (work / name).write_text(localise(code))
    assert {"proj.py", "call.py"} <= set(files(GETTING_STARTED))
    env = clean_env(venv) | {"PYTHONPATH": str(work)}

    def run(command: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            command.split(), cwd=work, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, f"{command}: {out.returncode}\n{out.stdout}{out.stderr}"
        assert "Traceback" not in out.stderr, out.stderr
        return out

    worker: subprocess.Popen[bytes] | None = None
    log = tmp_path / "worker.log"
    outputs: dict[str, str] = {}
    try:
        for command in lines[1:]:
            if " worker " in command:
                with log.open("wb") as sink:
                    worker = subprocess.Popen(
                        command.split(), cwd=work, env=env, stdout=sink, stderr=subprocess.STDOUT
                    )
                wait_for(lambda: "ready." in log.read_text(), 120, "the worker to be ready")
                continue
            outputs[command] = run(command).stdout
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
    assert worker is not None, "the page starts no worker"
    called = outputs["python call.py"]
    assert "report for account 42" in called, called
    assert "AcceptedResult(key='report-42'" in called, called
    assert "celery -A proj lease list" in outputs
    assert "report for account 42" in outputs["celery -A proj lease results report-42"]
