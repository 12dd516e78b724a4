"""Apex is detected by its compiled extensions, never by the package name; importing hf_apex never imports apex."""

import subprocess
import sys
import textwrap

import pytest

from hf_apex import import_utils


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A folder on sys.path where tests lay out fake apex installs."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [
        m for m in sys.modules if m == "apex" or m.startswith("apex.") or m in ("amp_C", "fused_layer_norm_cuda")
    ]:
        monkeypatch.delitem(sys.modules, name)
    import_utils.clear_caches()
    yield tmp_path
    import_utils.clear_caches()


def _write(root, rel, text=""):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_unrelated_pypi_apex_is_not_nvidia_apex(fake_site):
    _write(fake_site, "apex/__init__.py", "# the Pyramid toolkit also called apex\n")
    assert not import_utils.is_apex_available()
    assert not import_utils.is_fused_adam_available()


def test_python_only_apex_build_counts_as_no_kernels(fake_site):
    _write(fake_site, "apex/__init__.py")
    _write(fake_site, "apex/optimizers/__init__.py")
    _write(fake_site, "apex/multi_tensor_apply.py", "class _A:\n    available = False\nmulti_tensor_applier = _A()\n")
    assert import_utils.is_apex_available()
    assert not import_utils.is_fused_adam_available()
    assert not import_utils.is_fused_norm_available()
    assert "not installed" in import_utils.apex_extension_error("hf_apex_no_such_extension")


def test_built_extensions_are_detected(fake_site):
    _write(fake_site, "apex/__init__.py")
    _write(fake_site, "apex/optimizers/__init__.py")
    _write(fake_site, "apex/normalization/__init__.py")
    _write(fake_site, "apex/normalization/fused_layer_norm.py")
    _write(fake_site, "apex/multi_tensor_apply.py", "class _A:\n    available = True\nmulti_tensor_applier = _A()\n")
    _write(fake_site, "amp_C.py")
    _write(fake_site, "fused_layer_norm_cuda.py")
    assert import_utils.is_fused_adam_available()
    assert import_utils.is_fused_norm_available()


def test_broken_extension_reports_its_load_error(fake_site):
    _write(fake_site, "fused_layer_norm_cuda.py", "raise OSError('undefined symbol: _ZN3c10')\n")
    assert "undefined symbol" in import_utils.apex_extension_error("fused_layer_norm_cuda")


def test_import_hf_apex_never_imports_apex(tmp_path):
    # A fake apex that fails loudly on import proves nothing in hf_apex touches it.
    _write(tmp_path, "apex/__init__.py", "raise RuntimeError('hf_apex imported apex')\n")
    _write(tmp_path, "apex/optimizers/__init__.py")
    code = (
        "import hf_apex, hf_apex.trainer, hf_apex.doctor, hf_apex.callbacks, hf_apex.surgery, sys; "
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
        "import hf_apex.trainer, hf_apex.surgery; from hf_apex import rewire, unrewire, ApexTrainer, STAGES; "
        "assert callable(rewire) and callable(unrewire) and rewire.__name__ == 'rewire'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
