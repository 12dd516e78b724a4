"""Apex is detected by its compiled extensions, never by the package name; importing hf_apex never imports apex;
the blocker names what really stops apex; the build record names the commit really built, or says unknown."""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

from hf_apex.build_apex import (
    KNOWN_EXPORTS,
    BuildError,
    build_wheel,
    identify_commit,
    source_tree_hash,
    wanted_extensions,
)
from hf_apex.kernels.apex import availability


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A folder on sys.path where tests lay out fake apex installs."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in _apex_modules():
        monkeypatch.delitem(sys.modules, name)
    availability.clear_caches()
    yield tmp_path
    for name in _apex_modules():  # the fakes this test imported (monkeypatch then puts back what was there)
        del sys.modules[name]
    availability.clear_caches()


def _apex_modules() -> list[str]:
    return [m for m in sys.modules if m == "apex" or m.startswith("apex.") or m in ("amp_C", "fused_layer_norm_cuda")]


def _write(root, rel, text=""):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_unrelated_pypi_apex_is_not_nvidia_apex(fake_site):
    _write(fake_site, "apex/__init__.py", "# the Pyramid toolkit also called apex\n")
    assert not availability.is_apex_available()
    assert not availability.is_fused_adam_available()


def test_python_only_apex_build_counts_as_no_kernels(fake_site):
    _write(fake_site, "apex/__init__.py")
    _write(fake_site, "apex/optimizers/__init__.py")
    _write(fake_site, "apex/multi_tensor_apply.py", "class _A:\n    available = False\nmulti_tensor_applier = _A()\n")
    assert availability.is_apex_available()
    assert not availability.is_fused_adam_available()
    assert not availability.is_fused_norm_available()
    assert "not installed" in availability.extension_error("hf_apex_no_such_extension")
    assert "amp_C` is not installed" in availability.install_error("fused_adam")


def test_built_extensions_are_detected(fake_site):
    _write(fake_site, "apex/__init__.py")
    _write(fake_site, "apex/optimizers/__init__.py")
    _write(fake_site, "apex/normalization/__init__.py")
    _write(fake_site, "apex/normalization/fused_layer_norm.py")
    _write(fake_site, "apex/multi_tensor_apply.py", "class _A:\n    available = True\nmulti_tensor_applier = _A()\n")
    _write(fake_site, "amp_C.py")
    _write(fake_site, "fused_layer_norm_cuda.py")
    assert availability.is_fused_adam_available()
    assert availability.is_fused_norm_available()


def test_broken_extension_reports_its_load_error(fake_site):
    _write(fake_site, "fused_layer_norm_cuda.py", "raise OSError('undefined symbol: _ZN3c10')\n")
    assert "undefined symbol" in availability.extension_error("fused_layer_norm_cuda")


def test_import_hf_apex_never_imports_apex(tmp_path):
    # A fake apex that fails loudly on import proves nothing in hf_apex touches it.
    _write(tmp_path, "apex/__init__.py", "raise RuntimeError('hf_apex imported apex')\n")
    _write(tmp_path, "apex/optimizers/__init__.py")
    code = (
        "import hf_apex, hf_apex.trainer, hf_apex.doctor, hf_apex.measure.callback, sys; "
        "import hf_apex.kernels.models.surgery; "
        "from hf_apex import ApexTrainer, ApexTrainingArguments, rewire, unrewire, STAGES; "
        "assert 'apex' not in sys.modules, 'apex was imported'"
    )
    env_path = f"{tmp_path}:{':'.join(p for p in sys.path if p)}"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": env_path}, timeout=300
    )
    assert out.returncode == 0, out.stderr


def test_public_names_are_the_functions_even_after_submodules_load():
    code = (
        "import hf_apex.trainer, hf_apex.kernels.models.surgery; "
        "from hf_apex import rewire, unrewire, ApexTrainer, STAGES; "
        "assert callable(rewire) and callable(unrewire) and rewire.__name__ == 'rewire'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_the_blocker_names_the_missing_gpu_first(monkeypatch):
    monkeypatch.setattr(availability.torch.cuda, "is_available", lambda: False)
    assert availability.blocker("layer_norm") == "no CUDA GPU is visible"
    assert "cpu tensors" in availability.blocker("fused_adam", "cpu")
    assert "NVIDIA GPUs" in availability.fix_for(availability.blocker("layer_norm"))
    assert "make apex" in availability.fix_for("NVIDIA apex is not installed")
    assert availability.fix_for("torch.float64 inputs (apex's norms take fp32, fp16 and bf16)") == ""


def test_portable_paths_hide_the_machine_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert availability.portable_path(tmp_path / ".deps" / "apex") == ".deps/apex"
    assert availability.portable_path(sys.prefix + "/lib/site-packages/apex") == "<prefix>/lib/site-packages/apex"
    elsewhere = os.path.join(os.sep, "srv", "x", "y", "apex")  # (put together: no machine path in the tree)
    assert availability.portable_path(elsewhere) == "…/y/apex"


def _git(cwd, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True
    )


def test_a_source_export_inside_another_checkout_is_not_that_checkout(tmp_path):
    """`.deps/apex` inside the hf_apex repository: git answers for the enclosing repository, so the commit must
    come from the files themselves, or be unknown."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("outer")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "commit", "-qm", "outer")
    src = tmp_path / ".deps" / "apex"
    (src / "apex").mkdir(parents=True)
    (src / "setup.py").write_text("print('apex')\n")
    (src / "apex" / "__init__.py").write_text("")
    unknown = identify_commit(src, "cafe" * 10)
    assert unknown["commit"] == "unknown" and unknown["declared_commit"] == "cafe" * 10
    KNOWN_EXPORTS["cafe" * 10] = source_tree_hash(src)
    try:
        assert identify_commit(src, "cafe" * 10)["commit"] == "cafe" * 10
        (src / "build").mkdir()  # what `pip install` leaves behind changes nothing
        (src / "build" / "x.o").write_text("")
        assert identify_commit(src, "cafe" * 10)["commit"] == "cafe" * 10
        (src / "setup.py").write_text("print('patched')\n")
        assert identify_commit(src, "cafe" * 10)["commit"] == "unknown"
    finally:
        del KNOWN_EXPORTS["cafe" * 10]


def test_a_git_checkout_names_its_head(tmp_path):
    (tmp_path / "setup.py").write_text("")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "setup.py")
    _git(tmp_path, "commit", "-qm", "apex")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert identify_commit(tmp_path, "whatever") == {"commit": head, "commit_source": "git checkout"}
    (tmp_path / "setup.py").write_text("changed")
    assert identify_commit(tmp_path, "whatever")["commit_source"] == "git checkout with local changes"


def test_source_tree_hash_is_gits_tree_hash(tmp_path):
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "sub" / "run.sh").chmod(0o755)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "t")
    tree = subprocess.run(["git", "rev-parse", "HEAD^{tree}"], cwd=tmp_path, capture_output=True, text=True)
    assert source_tree_hash(tmp_path) == tree.stdout.strip()


def _fake_apex_source(root):
    """A source folder whose setup.py, like apex's, declares its extensions and calls setuptools' setup(): three C
    extensions that the machine's C compiler builds in a second."""
    for name in ("alpha", "beta", "gamma"):
        _write(
            root,
            f"{name}.c",
            f"""
            #include <Python.h>
            static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "{name}", NULL, -1, NULL}};
            PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&module); }}
            """,
        )
    _write(root, "fakeapex/__init__.py")
    _write(
        root,
        "setup.py",
        """
        from setuptools import Extension, find_packages, setup

        exts = [Extension(name, [name + ".c"]) for name in ("alpha", "beta", "gamma")]
        setup(name="fakeapex", version="0.1", packages=find_packages(), ext_modules=exts)
        """,
    )


@pytest.mark.skipif(
    shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None
    or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    reason="needs a C compiler and Python's headers to build the stand-in extensions",
)
def test_a_build_of_some_extensions_compiles_those_alone(tmp_path):
    """`make apex APEX_EXTENSIONS=...`: the source's own setup.py builds the wheel, handed only the named
    extensions; the Python package is in it whole; a name the source does not declare stops the build."""
    src, out = tmp_path / "src", tmp_path / "out"
    out.mkdir()
    _fake_apex_source(src)
    wheel = build_wheel(src, ["alpha", "gamma"], dict(os.environ), out)
    files = zipfile.ZipFile(wheel).namelist()
    built = sorted(name.split(".")[0] for name in files if name.endswith(".so"))
    assert built == ["alpha", "gamma"]
    assert "fakeapex/__init__.py" in files
    with pytest.raises(BuildError, match="setup.py failed"):
        build_wheel(src, ["alpha", "delta"], dict(os.environ), tmp_path)


def test_the_hf_apex_extension_set_is_what_hf_apex_loads():
    assert wanted_extensions("all") is None
    assert wanted_extensions("hf_apex") == sorted(set(availability.EXTENSIONS.values()))
    assert wanted_extensions("hf_apex") == ["amp_C", "fused_layer_norm_cuda"]
    assert wanted_extensions(" amp_C, syncbn ") == ["amp_C", "syncbn"]
    with pytest.raises(BuildError, match="names no extension"):
        wanted_extensions(" , ")
