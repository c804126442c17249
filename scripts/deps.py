"""The dependency sets the test modes install (used by scripts/setup.sh).

    python scripts/deps.py oldest          # constraints: every declared minimum, pinned
    python scripts/deps.py freeze VENV     # constraints: what VENV holds (after a green run)

``oldest`` reads pyproject.toml's ``dependencies`` and the extras that ``all`` and ``test``
install, and pins each ``name>=X`` to ``name==X``; the linters (ruff, mypy) are left to the
tested pins, since their versions decide style rules, not what the library runs on.
``freeze`` writes the versions installed in a virtual environment, for
``requirements/tested.txt`` (the constraints CI installs).
"""

from __future__ import annotations

import datetime
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINTERS = {"ruff", "mypy"}


def declared() -> list[str]:
    """Every requirement that ``pip install -e '.[all,test]'`` asks for directly."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    out = list(project["dependencies"])
    for reqs in extras.values():
        out += [r for r in reqs if not r.startswith("multihead")]
    return out


def oldest() -> str:
    pins: dict[str, str] = {}
    for req in declared():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)\s*(,.*)?", req)
        if match is None:
            raise SystemExit(f"deps.py: {req!r} in pyproject.toml has no '>=' minimum")
        name, low = match.group(1).lower(), match.group(2)
        if name not in LINTERS:
            pins[name] = low
    lines = [f"{name}=={low}" for name, low in sorted(pins.items())]
    return "# every declared minimum (python scripts/deps.py oldest)\n" + "\n".join(lines) + "\n"


def freeze(venv: Path) -> str:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"deps.py: {venv} is not a virtual environment (no bin/python)")
    listed = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--exclude-editable", "--all"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    keep = []
    for line in listed:
        if "==" not in line or line.startswith(("pip==", "setuptools==", "wheel==")):
            continue
        name, version = line.split("==", 1)
        keep.append(f"{name}=={version.split('+')[0]}")  # torch 2.13.0+cpu: any build of 2.13.0
    version = subprocess.run(
        [str(python), "-c", "import platform; print(platform.python_version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    head = (
        f"# The versions the suite last passed with (python scripts/deps.py freeze {venv.name},\n"
        f"# {datetime.date.today()}, Python {version}, {platform.machine()}). CI installs these.\n"
    )
    return head + "\n".join(sorted(keep, key=str.lower)) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["oldest"] and len(argv) == 1:
        sys.stdout.write(oldest())
    elif argv[:1] == ["freeze"] and len(argv) == 2:
        sys.stdout.write(freeze(Path(argv[1])))
    else:
        print("usage: python scripts/deps.py oldest | freeze VENV", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
