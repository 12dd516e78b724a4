"""Checks `make test-lowest`'s environment: .ci/lowest.txt pins each of pyproject.toml's lower bounds, and this
interpreter has exactly those versions (and Python at requires-python's lower bound). Prints them; exits 1 if not."""

import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOWEST_EXTRAS = ("trl",)  # the extras `make test-lowest` installs at their lower bounds (the others: newest)


def release(version: str) -> tuple[int, ...]:
    """'2.11' and '2.11.0+cu130' -> (2, 11): the release numbers, trailing zeros and local label dropped."""
    parts = [int(p) for p in re.match(r"\d+(\.\d+)*", version).group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def main() -> int:
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    bounds = dict(re.findall(r'^\s*"([A-Za-z0-9_.-]+)>=([0-9.]+)', deps, re.M))
    for extra in LOWEST_EXTRAS:  # optional dependencies whose lower bound is tested too
        listed = re.search(rf"^{extra} = \[(.*?)\]", pyproject, re.M).group(1)
        bounds.update(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)', listed))
    python = re.search(r'^requires-python = ">=([0-9.]+)"', pyproject, re.M).group(1)
    pins = dict(
        line.split("==")
        for line in (raw.split("#")[0].strip() for raw in (ROOT / ".ci/lowest.txt").read_text().splitlines())
        if line
    )
    problems = []
    if set(pins) != set(bounds):
        problems.append(f".ci/lowest.txt pins {sorted(pins)}, pyproject.toml bounds {sorted(bounds)}")
    installed = {}
    for name, pin in pins.items():
        if name in bounds and release(pin) != release(bounds[name]):
            problems.append(f"{name}: .ci/lowest.txt pins {pin}, pyproject.toml says >={bounds[name]}")
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed[name] = "missing"
        if installed[name] == "missing" or release(installed[name]) != release(pin):
            problems.append(f"{name}: installed {installed[name]}, .ci/lowest.txt pins {pin}")
    here = ".".join(map(str, sys.version_info[:3]))
    if release(here)[:2] != release(python)[:2]:
        problems.append(f"python {here}, requires-python says >={python} (LOWEST_PYTHON picks the interpreter)")
    print("lowest versions: python " + here + "".join(f", {n} {v}" for n, v in installed.items()))
    for problem in problems:
        print(f"lowest versions: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
