"""Every tracked text file is read on other machines than the one that wrote it: none names a path of that machine."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# An absolute path into a machine's own layout: a home, user or scratch folder, a system or install prefix, an
# installed package's folder, a Windows drive. The character before it is not one that makes it part of something
# else: a word (`shared/data`), `.` or `~` (`./srv/`, `~/x`: relative), `/` or `:` (a URL's `//host/home/...`);
# and for an installed package's folder, `>` (`<prefix>/lib/...`, hf_apex's portable form), whose path from the root
# has two folders or more before site-packages (a fragment such as `sys.prefix + "/lib/site-packages"` is not one).
ROOTS = "home|root|tmp|work|workspace|scratch|usr|opt|srv|mnt|var|Users|private|Volumes|nfs|lustre|gpfs"
MACHINE_PATH = re.compile(
    rf"(?<![\w.~/:])/(?:{ROOTS})/[\w.@+-]"  # a root folder of ROOTS, then a name
    r"|(?<![\w.~/:>])/(?:[\w.+-]+/){2,}(?:site|dist)-packages/"  # an install prefix, then site-packages
    r"|(?<![\w\\])[A-Za-z]:\\\\?[A-Za-z]"  # a drive letter, written with one backslash or two
)
# An absolute path that is not a machine's: the same on every POSIX system (a script's interpreter line).
NOT_MACHINE = re.compile(r"#!/usr/bin/env\b")


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, the line) for each line of ``text`` that names an absolute path of some machine."""
    return [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if MACHINE_PATH.search(NOT_MACHINE.sub("", line))
    ]


def tracked_text_files() -> list[Path]:
    """Every file git tracks here that exists and reads as UTF-8 text (no NUL byte)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    files = []
    for name in out.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file():  # (deleted in the working tree, not yet in the index)
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def test_no_tracked_file_names_a_path_of_this_or_any_machine():
    found = {}
    for path in tracked_text_files():
        hits = machine_paths(path.read_text(encoding="utf-8"))
        if hits:
            found[str(path.relative_to(REPO))] = hits[:3]
    assert not found, "absolute machine paths (make them repository-relative, or `<prefix>`, `~`):\n" + "\n".join(
        f"  {name}:{n}: {line[:160]}" for name, hits in found.items() for n, line in hits
    )


def test_the_check_tells_machine_paths_from_the_rest():
    """The pattern itself, on paths put together here (written out whole, they would fail the test above)."""
    slash, back = "/", "\\"
    machine = [
        f"data in {slash}home/alice/data",
        f"cd {slash}work/main && make",
        f"OUT=${{OUT:-{slash}tmp/cpub}}",
        f"{slash}root/.cache/huggingface",
        f"{slash}usr/local/cuda/bin/nvcc",
        f"{slash}opt/conda/lib/python3.12/site-packages/torch/__init__.py",
        f"{slash}scratch/runs/x",
        f"C:{back}Users{back}alice",
        f'"C:{back}{back}Users{back}{back}alice"',
    ]
    other = [
        "#!/usr/bin/env python3",
        "#!/bin/bash",
        "2>/dev/null; read /proc/self/stat",
        "https://github.com/home/srv/blob/main/x.py",
        "../shared/data/tokenizers/gpt2 and .deps/data",
        "<prefix>/lib/python3.12/site-packages/apex and …/site/apex",
        "~/scratch/x and ./srv/y and $HOME/scratch/z",
        "Paths are shown from `site-packages/` on",
        'sys.prefix + "/lib/site-packages/apex"',
        r"a regex r'line:\s+' and (?:\d+)",
        "git show 46ca0e8:benchmarks/h200-2026-12-03-vector/",
    ]
    assert [bool(machine_paths(t)) for t in machine] == [True] * len(machine)
    assert [t for t in other if machine_paths(t)] == []
