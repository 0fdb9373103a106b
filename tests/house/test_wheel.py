"""The wheel holds the product (and ``shardsync verify``), not the test scaffolding or the source-checkout programs.

Built here from the working tree with the project's own build backend (setuptools, no network: no build isolation).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, cwd=build, timeout=600)
    (whl,) = out.glob("shardsync-*.whl")
    return zipfile.ZipFile(whl)


def test_the_wheel_holds_no_test_scaffolding(wheel):
    names = wheel.namelist()
    py = [n for n in names if n.endswith(".py")]
    scaffolding = [n for n in py if n.startswith(("shardsync/testing/", "shardsync/programs/"))
                   or "/testing/" in n or n.startswith("tests/")]
    assert not scaffolding, f"the wheel ships test scaffolding: {scaffolding[:10]}"
    for needed in ("shardsync/__init__.py", "shardsync/cli.py", "shardsync/config.py",
                   "shardsync/engine/producer/producer.py", "shardsync/engine/consumer/consumer.py",
                   "shardsync/integrations/vllm/worker_backend.py", "shardsync/integrations/vllm/trainer_backend.py",
                   "shardsync/verify/program.py", "shardsync/verify/reference.py", "shardsync/configs/kimi-k2.json"):
        assert needed in names, f"the wheel lacks {needed}"
    src = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "shardsync").rglob("*.py")}
    product = {p for p in src if not p.startswith(("shardsync/testing/", "shardsync/programs/"))}
    assert product == set(py), f"the wheel and the product differ: {sorted(product ^ set(py))[:10]}"


def test_the_product_in_the_wheel_imports_no_scaffolding(wheel, tmp_path):
    """Unpacked alone (no source checkout on the path), the shipped modules that need neither vLLM nor Ray import."""
    wheel.extractall(tmp_path)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import shardsync, shardsync.config, shardsync.engine.producer.producer, shardsync.engine.consumer.consumer,"
            " shardsync.verify.output, shardsync.cli; "
            "bad = [m for m in sys.modules if m.startswith(('shardsync.testing', 'shardsync.programs'))]; "
            "assert not bad, bad; assert shardsync.__file__.startswith(sys.argv[1]), shardsync.__file__")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=tmp_path, timeout=120)
