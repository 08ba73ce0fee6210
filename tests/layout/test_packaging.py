"""A built wheel holds every package: the list in pyproject.toml is checked against the folders on disk (a wheel that
left out decodelab.core.kv installed and then failed on every command)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(tool["packages"])
    on_disk = set()
    for name, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((name,) + rel))
    assert listed == on_disk, {"missing": sorted(on_disk - listed), "not a folder": sorted(listed - on_disk)}


def test_requires_python_allows_what_the_code_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["requires-python"].startswith(">=3.11")  # tomllib is 3.11+
