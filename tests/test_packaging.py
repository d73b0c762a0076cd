"""Packaging invariants: the wheel holds every subpackage, the client stands alone, and the
checked-in protobuf stubs are exactly what protoc generates from rollout.proto."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"
GENERATED = ("rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py")
# Folder on disk -> import name, as in pyproject's package-dir.
PACKAGE_ROOTS = {"client": "rollserve.client", "server": "rollserve.server"}


def _disk_modules() -> set[str]:
    """Every module file under the package folders, as its path inside the wheel."""
    expected = set()
    for folder, name in PACKAGE_ROOTS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            relative = path.relative_to(ROOT / folder)
            expected.add("/".join([*name.split("."), *relative.parts]))
    for name in ("__init__.py", *GENERATED, "rollout.proto"):
        expected.add(f"rollserve/v1/{name}")
    return expected


def test_generated_stubs_match_proto(tmp_path: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        str(PROTO_DIR / "rollserve/v1/rollout.proto"),
    ]
    assert protoc.main(args) == 0
    for name in GENERATED:
        fresh = (tmp_path / "rollserve/v1" / name).read_text()
        checked_in = (PROTO_DIR / "rollserve/v1" / name).read_text()
        assert fresh == checked_in, f"{name} is stale: run `make proto` and commit the result"


def test_dependency_floors_equal_generated_runtime_versions() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = {
        re.split(r"[<>=!~ \[]", d, maxsplit=1)[0]: d for d in pyproject["project"]["dependencies"]
    }
    grpc_stub = (PROTO_DIR / "rollserve/v1/rollout_pb2_grpc.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1)
    pb_stub = (PROTO_DIR / "rollserve/v1/rollout_pb2.py").read_text()
    pb_version = re.search(r"# Protobuf Python Version: ([\d.]+)", pb_stub).group(1)
    assert deps["grpcio"] == f"grpcio>={grpc_version}"
    assert deps["protobuf"] == f"protobuf>={pb_version}"


def test_every_subpackage_is_listed_in_pyproject() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    on_disk = {"rollserve.v1"}
    for folder, name in PACKAGE_ROOTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join([name, *parts]))
    assert listed == on_disk


@pytest.mark.slow
def test_wheel_contains_every_module(tmp_path: Path) -> None:
    # Build from a copy so the build does not write into the checkout the tests run from.
    build_dir = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("client", "server", "protos"):
        shutil.copytree(ROOT / name, build_dir / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, build_dir / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(build_dir),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("rollserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _disk_modules() - names
    assert not missing, f"missing from the wheel: {sorted(missing)}"
    assert not any(n.startswith("tests/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "rollserve = rollserve.server.serving.cli:main" in scripts


def test_client_imports_without_transformers() -> None:
    code = (
        "import pkgutil, importlib, sys\n"
        "import rollserve.client as c\n"
        "for m in pkgutil.walk_packages(c.__path__, 'rollserve.client.'):\n"
        "    importlib.import_module(m.name)\n"
        "import rollserve.v1.rollout_pb2_grpc\n"
        "heavy = ('transformers', 'tokenizers')\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in heavy)\n"
        "assert not bad, bad\n"
        "print('ok', len(list(pkgutil.walk_packages(c.__path__))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
