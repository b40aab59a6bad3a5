"""setup.cfg lists every package of the tree, so the wheel holds every module.

setup.cfg names its packages one by one: a new package left out of the list
builds a wheel that installs, then fails at its first import. The tests that
install the wheel run only in .ci/run's long runs; this catches the omission
in the default suite, in milliseconds.
"""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _options() -> configparser.SectionProxy:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg["options"]


def package_dirs() -> dict[str, Path]:
    """The directory of each package the tree holds: celery_lease's own, and
    those setup.cfg's package_dir places elsewhere (the migrations)."""
    roots = {"celery_lease": ROOT / "celery_lease"}
    for line in _options()["package_dir"].strip().splitlines():
        name, _, where = (part.strip() for part in line.partition("="))
        roots[name] = ROOT / where
    found = {}
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            found[".".join([name, *init.parent.relative_to(root).parts])] = init.parent
    return found


def test_setup_cfg_lists_every_package_of_the_tree() -> None:
    tree, listed = set(package_dirs()), set(_options()["packages"].split())
    assert {"celery_lease", "celery_lease.migrations.versions"} <= tree & listed
    assert tree - listed == set(), "packages setup.cfg leaves out of the wheel"
    assert listed - tree == set(), "packages setup.cfg lists that the tree lacks"
