"""Build NVIDIA Apex from source with its C++ and CUDA extensions (what ``make apex`` runs).

Checks before compiling, each with a message that says what to do:
- torch is a CUDA build, and nvcc's CUDA version equals ``torch.version.cuda`` (apex refuses otherwise);
- ``TORCH_CUDA_ARCH_LIST`` is set, or derived from the visible GPUs.
Then ``APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation --no-deps <src>`` with
``APEX_PARALLEL_BUILD`` jobs, and records the build (commit, arch list, versions) next to the installed
package in ``apex/_hf_apex_build.json`` so every metrics file can name the apex commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

APEX_REPO = "https://github.com/NVIDIA/apex"
DEFAULT_COMMIT = "6424da3b4faa6c8f062da4a48c424fff3f02d42d"


class BuildError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"make apex: {message}")


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


def source_dir(src: str | None, commit: str, workdir: Path) -> tuple[Path, str]:
    """The apex checkout to build and the commit it holds."""
    if src:
        path = Path(src).resolve()
        if not (path / "setup.py").is_file():
            raise BuildError(f"APEX_SRC={src} has no setup.py; point it at an apex checkout.")
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            return path, head.stdout.strip()
        return path, f"{commit} (declared: the source is not a git checkout)"
    path = workdir / "apex"
    if not (path / ".git").is_dir():
        subprocess.run(["git", "clone", "--filter=blob:none", APEX_REPO, str(path)], check=True)
    have = subprocess.run(["git", "-C", str(path), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if have.returncode != 0:  # an earlier clone, made for another pinned commit
        subprocess.run(["git", "-C", str(path), "fetch", "--quiet", "origin", commit], check=True)
    subprocess.run(["git", "-C", str(path), "checkout", "--quiet", commit], check=True)
    return path, commit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", help="local apex checkout (default: clone NVIDIA/apex at --commit)")
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help="apex commit to clone (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compile jobs (APEX_PARALLEL_BUILD)")
    parser.add_argument("--workdir", default=".deps", help="where to clone apex when --src is absent")
    args = parser.parse_args(argv)

    nvcc, torch_cuda = check_cuda_versions()
    archs = arch_list()
    src, commit = source_dir(args.src, args.commit, Path(args.workdir))
    env = dict(os.environ, APEX_CPP_EXT="1", APEX_CUDA_EXT="1", TORCH_CUDA_ARCH_LIST=archs)
    env["APEX_PARALLEL_BUILD"] = str(args.jobs)
    env.setdefault("MAX_JOBS", str(args.jobs))
    print(f"make apex: building {src} ({commit}) for TORCH_CUDA_ARCH_LIST={archs}, CUDA {nvcc}, {args.jobs} jobs")
    started = time.time()
    cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", str(src)]
    subprocess.run(cmd, env=env, check=True)
    seconds = time.time() - started

    import torch

    probe = "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('apex').origin).parent)"
    location = Path(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/"
        ).stdout.strip()
    )
    record = {
        "commit": commit,
        "source": str(src),
        "torch_cuda_arch_list": archs,
        "nvcc": nvcc,
        "torch": torch.__version__,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 1),
    }
    (location / "_hf_apex_build.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"make apex: built in {seconds:.0f} s; installed at {location}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
