"""What a user installs: ``python -m build`` makes an sdist and a wheel; the wheel installs into a clean
venv (with the stack's lock), holds nothing outside ``dispatch_io``, and its command and the demo run
from it, away from this checkout.

The wheel is built once (from the sdist, as ``build`` does). The running interpreter is always checked;
``DIO_WHEEL_PYTHONS`` (paths, comma-separated) adds others, which ``.ci/run`` uses for Python 3.12.
"""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHONS = [sys.executable] + [p for p in os.environ.get("DIO_WHEEL_PYTHONS", "").split(",") if p]


def run(*args, cwd, env=None, timeout=900) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", str(out), str(ROOT), cwd=out)
    return out


def test_the_sdist_and_wheel_hold_the_package_and_nothing_beside_it(dist):
    (wheel,) = dist.glob("dispatch_io-*-py3-none-any.whl")
    (sdist,) = dist.glob("dispatch_io-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"dispatch_io", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    assert "dispatch_io/workers/tensorstore_io.py" in names and "dispatch_io/manager/tiers/__init__.py" in names
    packages = {os.path.dirname(n) for n in names if n.endswith(".py")}
    assert all(f"{p}/__init__.py" in names for p in packages), packages  # every folder is a package shipped
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "Requires-Python: >=3.11" in metadata and "Requires-Dist: jax<0.13,>=0.10.2" in metadata, metadata[:2000]
    assert sdist.stat().st_size > 0


@pytest.mark.parametrize("python", PYTHONS)
def test_the_wheel_installs_in_a_clean_venv_and_runs(dist, tmp_path, python):
    version = run(python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])", cwd=tmp_path).strip()
    lock = ROOT / "scripts" / ("lock-oldest.txt" if version == "3.11" else "lock-newest.txt")
    venv = tmp_path / "venv"
    run(python, "-m", "venv", str(venv), cwd=tmp_path)
    (wheel,) = dist.glob("*.whl")
    run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(lock), str(wheel), cwd=tmp_path)
    away = tmp_path / "elsewhere"   # no checkout on sys.path: only what the wheel installed
    away.mkdir()
    assert run(str(venv / "bin" / "dispatch-io"), "--version", cwd=away).startswith("dispatch-io ")
    found = run(str(venv / "bin" / "python"), "-c", "import dispatch_io.workers as w, importlib.util as u; "
                "print(w.__file__); print(u.find_spec('workers'))", cwd=away)
    assert str(venv) in found.splitlines()[0] and found.splitlines()[1] == "None", found
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")} | {"JAX_PLATFORMS": "cpu"}
    out = run(str(venv / "bin" / "python"), str(ROOT / "examples" / "save_restore.py"), str(away / "ckpt"),
              cwd=away, env=env)
    assert out.count("bit-exact") == 2 and out.splitlines()[-1] == "OK", out


def test_every_package_of_the_checkout_is_listed_for_the_wheel():
    """pyproject.toml names the packages the wheel ships one by one (``workers/`` maps to
    ``dispatch_io.workers``): a package folder added to the checkout and not listed there would
    be left out of the wheel while the suite, run from the checkout, still imports it."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "dispatch_io").rglob("__init__.py")}
    found |= {".".join(("dispatch_io",) + init.parent.relative_to(ROOT).parts)
              for init in (ROOT / "workers").rglob("__init__.py")}
    assert listed == found, (sorted(found - listed), sorted(listed - found))
