"""The floors CI installs (.ci/floors.sh) are pyproject's lower bounds, for every runtime dependency."""

from __future__ import annotations

import re
import tomllib

from conftest import ROOT


def declared_floors() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", dep)
        assert m, f"{dep}: every runtime dependency declares a lower bound"
        out[m.group(1).lower()] = m.group(2)
    return out


def installed_floors() -> dict[str, str]:
    text = (ROOT / ".ci" / "floors.sh").read_text()
    line = re.search(r'^FLOORS="([^"]+)"', text, re.M).group(1)
    return dict(pin.lower().split("==") for pin in line.split())


def same_version(a: str, b: str) -> bool:
    pad = lambda v: [int(x) for x in v.split(".")] + [0] * (3 - len(v.split(".")))  # noqa: E731
    return pad(a) == pad(b)


def test_ci_installs_every_declared_floor():
    declared, installed = declared_floors(), installed_floors()
    assert set(declared) == set(installed)
    assert all(same_version(declared[k], installed[k]) for k in declared), (declared, installed)


def test_ci_runs_the_floors_and_the_small_gpu_script():
    run = (ROOT / ".ci" / "run").read_text()
    assert ".ci/floors.sh" in run and "benchmarks/gpu.py --small" in run
