"""Build cadlib's wheel from this checkout and check it: every module of ``cadlib/`` is in it, and every
module imports from the installed wheel (not from the source tree). ``make test`` runs it; editable
installs hide a package left out of the wheel.

    python scripts/check_wheel.py
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def source_modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in (ROOT / "cadlib").rglob("*.py")}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist"), str(ROOT)], check=True)
        (wheel,) = (tmp / "dist").glob("cadlib-*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
        missing = sorted(source_modules() - names)
        if missing:
            print(f"{wheel.name} lacks {len(missing)} modules of cadlib/: {', '.join(missing)}")
            return 1
        site = tmp / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                        str(wheel)], check=True)
        probe = ("import importlib, pkgutil, sys, cadlib\n"
                 f"assert cadlib.__file__.startswith({str(site)!r}), cadlib.__file__\n"
                 "mods = [m.name for m in pkgutil.walk_packages(cadlib.__path__, 'cadlib.')]\n"
                 "[importlib.import_module(m) for m in mods]\n"
                 "print(len(mods) + 1)\n")
        out = subprocess.run([sys.executable, "-c", probe], cwd=tmp, capture_output=True, text=True,
                             env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
        if out.returncode:
            print(f"importing cadlib from {wheel.name} failed:\n{out.stderr[-3000:]}")
            return 1
        print(f"{wheel.name}: all {len(source_modules())} modules of cadlib/ present; "
              f"{out.stdout.strip()} imported from the installed wheel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
