"""The version matrix: Python 3.10-3.13 x Celery x redis-py x SQLAlchemy, oldest and newest.

    nox -l                                  # list the sessions
    nox -s "tests-3.11(celery='5.3', redis='5', sqlalchemy='2.0')"
    nox -s tests -- tests/contract/store_contract -k redis    # any pytest arguments

Each session installs the package with its published extras, pins the three
libraries to the oldest supported line (``celery~=5.3.0``, ``redis~=5.0``,
``SQLAlchemy~=2.0.0``) or leaves them at the newest, adds the suite's tools
(requirements/test.txt), checks ``pip check`` and runs a cross-section of the
suite: the unit tests, the store contract, the result backend's contract, the
settings and the task acceptance tests with real workers. The servers come from the machine, as for
scripts/test (run scripts/test once as root to install them). Interpreters
nox cannot find are skipped: on a pyenv machine put them on PATH first, e.g.
``PATH=$(echo ~/.pyenv/versions/3.1[0-3]*/bin | tr ' ' :):$PATH nox -s tests``.

.ci/run runs scripts/test (the newest of everything, the machine's Python)
and then ``nox -s oldest``. The last full run of ``nox -s tests`` and what
each cell installed are in CONTRIBUTING.md ("Version matrix").
"""

from __future__ import annotations

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
OLDEST = {"celery": "celery~=5.3.0", "redis": "redis~=5.0", "sqlalchemy": "SQLAlchemy~=2.0.0"}
DEFAULT_TESTS = [
    "tests/unit",
    "tests/contract/store_contract",
    "tests/contract/test_result_backend.py",
    "tests/acceptance/test_settings.py",
    "tests/acceptance/test_task_acceptance.py",
    "tests/acceptance/test_task_basics.py",
]

#: the short oldest-supported run of .ci/run (nox -s oldest)
#: (the result backend's contract too: Celery's key-value base class it builds on
#: differs between the lines)
OLDEST_TESTS = [
    "tests/unit",
    "tests/contract/store_contract",
    "tests/contract/test_result_backend.py",
    # Celery's key-value chord protocol, whose details moved between 5.3 and 5.7
    "tests/contract/test_result_backend_chords.py",
    "tests/contract/test_chord_due.py",
]

nox.options.error_on_missing_interpreters = False
nox.options.reuse_existing_virtualenvs = True


#: (celery, redis, sqlalchemy) lines: every combination of oldest and newest,
#: except the newest Celery with redis-py 5, which cannot be installed (its
#: redis extra, kombu[redis], requires redis-py >= 6.4).
CELLS = [
    (celery, redis, sqlalchemy)
    for celery in ("5.3", "latest")
    for redis in ("5", "latest")
    for sqlalchemy in ("2.0", "latest")
    if not (celery == "latest" and redis == "5")
]


def pin(name: str, line: str) -> list[str]:
    return [OLDEST[name]] if line != "latest" else []


def install(session: nox.Session, celery: str, redis: str, sqlalchemy: str) -> None:
    pins = pin("celery", celery) + pin("redis", redis) + pin("sqlalchemy", sqlalchemy)
    session.install("-e", ".[redis,postgres,etcd,prometheus]", "-r", "requirements/test.txt", *pins)
    session.run("python", "-m", "pip", "check")
    session.run("python", "-m", "pip", "list")


@nox.session(python=PYTHONS)
@nox.parametrize(("celery", "redis", "sqlalchemy"), CELLS)
def tests(session: nox.Session, celery: str, redis: str, sqlalchemy: str) -> None:
    install(session, celery, redis, sqlalchemy)
    session.run("python", "-m", "pytest", "-q", "-n", "2", *(session.posargs or DEFAULT_TESTS))


@nox.session
def oldest(session: nox.Session) -> None:
    """The oldest supported lines on nox's own Python, short: .ci/run's second run."""
    install(session, "5.3", "5", "2.0")
    session.run("python", "-m", "pytest", "-q", "-n", "2", *(session.posargs or OLDEST_TESTS))


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    session.install("-r", "requirements/docs.txt")
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})
