"""Build NVIDIA Apex from source with its C++ and CUDA extensions (what ``make apex`` runs).

Checks before compiling, each with a message that says what to do:
- torch is a CUDA build, and nvcc's CUDA version equals ``torch.version.cuda`` (apex refuses otherwise);
- ``TORCH_CUDA_ARCH_LIST`` is set, or derived from the visible GPUs.
Then ``APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation --no-deps <src>`` with
``APEX_PARALLEL_BUILD`` jobs, and records the build (commit, arch list, versions, extensions) next to the installed
package in ``apex/_hf_apex_build.json`` so every metrics file can name the apex commit.

``--extensions hf_apex`` (``make apex APEX_EXTENSIONS=hf_apex``) compiles only the extensions hf_apex loads
(``amp_C`` for FusedAdam/FusedLAMB, ``fused_layer_norm_cuda`` for the norms) instead of every one apex builds
(twelve at the pinned commit): apex's own ``setup.py`` builds a wheel, with its sources, flags and parallel build,
but its ``setup()`` is handed only those extensions; the rest of apex is installed as Python, as apex ships it.

The commit is recorded only when it is known to be the one built: the source is the root of a git checkout
(its HEAD, marked when the tree has local changes), or its files hash to the ``git archive`` export of a commit
listed in :data:`KNOWN_EXPORTS`. A plain source tree inside some other git checkout (``.deps/apex`` in this
repository) is not mistaken for that checkout. Otherwise the record says ``"unknown"`` next to the commit you
declared.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .kernels.apex.availability import BUILD_RECORD, EXTENSION_NAMES, portable_path

APEX_REPO = "https://github.com/NVIDIA/apex"
DEFAULT_COMMIT = "6424da3b4faa6c8f062da4a48c424fff3f02d42d"
# commit -> source_tree_hash() of `git archive <commit>` (git's tree hash; submodules, exported empty, left out)
KNOWN_EXPORTS = {DEFAULT_COMMIT: "f188ce295c7ec588f2e697ab106fa63f47c6bc89"}


class BuildError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"make apex: {message}")


ALL_EXTENSIONS = "all"  # every extension apex's setup.py declares under APEX_CPP_EXT=1 APEX_CUDA_EXT=1
HF_APEX_EXTENSIONS = "hf_apex"  # the ones hf_apex loads (hf_apex.kernels.apex.availability.EXTENSION_NAMES)

# Run in the apex source folder: apex's setup.py builds a wheel into argv[1], its setup() handed only the extensions
# named in argv[2] (comma-separated) of those it declares.
_SETUP_WITH_ONLY = """
import runpy, setuptools, sys
out, wanted = sys.argv[1], sys.argv[2].split(",")
stock_setup = setuptools.setup
def setup(**kwargs):
    declared = [ext.name for ext in kwargs.get("ext_modules") or []]
    missing = [name for name in wanted if name not in declared]
    if missing:
        sys.exit(f"make apex: apex's setup.py declares no extension {', '.join(missing)}; it declares "
                 f"{', '.join(declared) or 'none'}")
    kwargs["ext_modules"] = [ext for ext in kwargs["ext_modules"] if ext.name in wanted]
    return stock_setup(**kwargs)
setuptools.setup = setup
sys.argv = ["setup.py", "bdist_wheel", "--dist-dir", out]
runpy.run_path("setup.py", run_name="__main__")
"""


def wanted_extensions(spec: str) -> list[str] | None:
    """The extensions to compile: None for all of apex's, else their names (``hf_apex``: those hf_apex loads)."""
    if spec == ALL_EXTENSIONS:
        return None
    if spec == HF_APEX_EXTENSIONS:
        return list(EXTENSION_NAMES)
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise BuildError(
            f"--extensions {spec!r} names no extension: give {ALL_EXTENSIONS}, {HF_APEX_EXTENSIONS} "
            "or extension names separated by commas"
        )
    return names


def build_wheel(src: Path, names: list[str], env: dict, out: Path) -> Path:
    """A wheel of apex from ``src`` whose compiled extensions are ``names`` alone, written into ``out``."""
    done = subprocess.run([sys.executable, "-c", _SETUP_WITH_ONLY, str(out), ",".join(names)], cwd=src, env=env)
    if done.returncode != 0:
        raise BuildError(f"apex's setup.py failed (exit {done.returncode}); its output is above.")
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"apex's setup.py left {len(wheels)} wheels in {out}, not one.")
    return wheels[0]


def arch_list() -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise BuildError(
            "no GPU is visible, so the CUDA architecture cannot be detected. Set it yourself, e.g. "
            "TORCH_CUDA_ARCH_LIST=9.0 for H100/H200, 8.0 for A100, 8.9 for L4/L40S, then run make apex again."
        )
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in caps)


def check_cuda_versions() -> tuple[str, str]:
    import torch

    from .doctor import nvcc_version

    if torch.version.cuda is None:
        raise BuildError(
            f"torch {torch.__version__} is a CPU build; apex's CUDA extensions need a CUDA build of torch."
        )
    nvcc = nvcc_version()
    if nvcc is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH); apex's CUDA extensions need it.")
    torch_cuda = ".".join(torch.version.cuda.split(".")[:2])
    if nvcc != torch_cuda:
        raise BuildError(
            f"nvcc is CUDA {nvcc} but torch {torch.__version__} was built with CUDA {torch_cuda}. apex refuses to "
            "build across versions: install the matching CUDA toolkit or a torch built for your nvcc."
        )
    return nvcc, torch_cuda


def _object_id(kind: bytes, body: bytes) -> bytes:
    return hashlib.sha1(kind + b" %d\0" % len(body) + body).digest()


def _build_output(child: Path, top: bool) -> bool:
    """Folders a build leaves in an apex source tree (none of them is tracked by apex's git)."""
    return (
        child.name in (".git", "__pycache__")
        or top
        and (child.name in ("build", "dist") or child.suffix == ".egg-info")
    )


def source_tree_hash(path: Path, top: bool = True) -> str | None:
    """git's tree hash of the files under ``path``, computed without git (build outputs, ``.git`` and empty
    folders left out)."""
    entries = []
    for child in path.iterdir():
        if _build_output(child, top):
            continue
        mode = child.lstat().st_mode
        if stat.S_ISLNK(mode):
            entries.append((child.name, b"120000", _object_id(b"blob", os.readlink(child).encode())))
        elif stat.S_ISDIR(mode):
            sub = source_tree_hash(child, top=False)
            if sub is not None:
                entries.append((child.name + "/", b"40000", bytes.fromhex(sub)))
        else:
            kind = b"100755" if mode & stat.S_IXUSR else b"100644"
            entries.append((child.name, kind, _object_id(b"blob", child.read_bytes())))
    if not entries:
        return None
    entries.sort(key=lambda e: e[0].encode())  # git orders a folder as if its name ended in "/"
    body = b"".join(kind + b" " + name.rstrip("/").encode() + b"\0" + oid for name, kind, oid in entries)
    return _object_id(b"tree", body).hex()


def identify_commit(path: Path, declared: str) -> dict:
    """What commit ``path`` holds, and how that is known; ``"unknown"`` when it cannot be shown."""

    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True)

    top = git("rev-parse", "--show-toplevel")
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == path.resolve():
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
        head = git("rev-parse", "HEAD").stdout.strip()
        return {"commit": head, "commit_source": "git checkout" + (" with local changes" if dirty else "")}
    if KNOWN_EXPORTS.get(declared) == source_tree_hash(path):
        return {"commit": declared, "commit_source": "source files match the git archive export of this commit"}
    return {"commit": "unknown", "declared_commit": declared, "commit_source": "not a git checkout; files unverified"}


def source_dir(src: str | None, commit: str, workdir: Path) -> tuple[Path, dict]:
    """The apex source to build and what is known of its commit."""
    if src:
        path = Path(src).resolve()
        if not (path / "setup.py").is_file():
            raise BuildError(f"APEX_SRC={src} has no setup.py; point it at an apex checkout.")
        return path, identify_commit(path, commit)
    path = workdir / "apex"
    if not (path / ".git").is_dir():
        subprocess.run(["git", "clone", "--filter=blob:none", APEX_REPO, str(path)], check=True)
    have = subprocess.run(["git", "-C", str(path), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if have.returncode != 0:  # an earlier clone, made for another pinned commit
        subprocess.run(["git", "-C", str(path), "fetch", "--quiet", "origin", commit], check=True)
    subprocess.run(["git", "-C", str(path), "checkout", "--quiet", commit], check=True)
    return path, identify_commit(path, commit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", help="local apex checkout (default: clone NVIDIA/apex at --commit)")
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help="apex commit to clone (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compile jobs (APEX_PARALLEL_BUILD)")
    parser.add_argument("--workdir", default=".deps", help="where to clone apex when --src is absent")
    parser.add_argument(
        "--extensions",
        default=ALL_EXTENSIONS,
        help=f"which extensions to compile: {ALL_EXTENSIONS} (default: every one apex builds), {HF_APEX_EXTENSIONS} "
        f"({', '.join(EXTENSION_NAMES)}: the ones hf_apex loads), or names separated by commas",
    )
    args = parser.parse_args(argv)
    names = wanted_extensions(args.extensions)

    nvcc, torch_cuda = check_cuda_versions()
    archs = arch_list()
    src, identity = source_dir(args.src, args.commit, Path(args.workdir))
    env = dict(os.environ, APEX_CPP_EXT="1", APEX_CUDA_EXT="1", TORCH_CUDA_ARCH_LIST=archs)
    env["APEX_PARALLEL_BUILD"] = str(args.jobs)
    env.setdefault("MAX_JOBS", str(args.jobs))
    print(
        f"make apex: building {portable_path(src)} (commit {identity['commit']}: {identity['commit_source']}) for "
        f"TORCH_CUDA_ARCH_LIST={archs}, CUDA {nvcc}, {args.jobs} jobs, extensions: {', '.join(names or ['all'])}"
    )
    started = time.time()
    if names is None:
        cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", str(src)]
        subprocess.run(cmd, env=env, check=True)
    else:
        with tempfile.TemporaryDirectory() as out:
            wheel = build_wheel(src, names, env, Path(out))
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)]
            subprocess.run(cmd, check=True)
    seconds = time.time() - started

    import torch

    probe = "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('apex').origin).parent)"
    location = Path(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/"
        ).stdout.strip()
    )
    record = {
        **identity,
        "source": portable_path(src),
        "torch_cuda_arch_list": archs,
        "nvcc": nvcc,
        "torch": torch.__version__,
        "extensions": names or ALL_EXTENSIONS,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 1),
    }
    (location / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    print(f"make apex: built in {seconds:.0f} s; installed at {portable_path(location)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
