"""The installed wheel where a user has only one framework, and the build backend's rules.

``./dev.sh test`` builds the Python 3.12 redistributable wheel (``./dev.sh wheel 3.12``)
and installs it into a torch-only and a jax-only environment (the oldest torch and jax that
install here); their interpreters arrive as GROUPGEMM_TORCH_ONLY_PYTHON and
GROUPGEMM_JAX_ONLY_PYTHON. They run with no CUDA toolkit in sight: no nvcc on PATH, no
CUDA_HOME, no library path, and nothing of the toolkit loaded.
"""

import os
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import build_backend  # noqa: E402

# What every environment checks first: the redistributable wheel, its CUDA backend compiled
# in, and no CUDA toolkit needed (the runtime is linked statically; libcuda, the driver's,
# is opened only when a GPU is used).
WHEEL = """
    import importlib.metadata, shutil
    import groupgemm
    from groupgemm import _core
    tags = [l.split()[1] for l in importlib.metadata.distribution("groupgemm").read_text("WHEEL").splitlines()
            if l.startswith("Tag:")]
    assert tags and all("-manylinux_" in t for t in tags), tags
    assert shutil.which("nvcc") is None
    assert not groupgemm.cuda_compiled() or "90a" in _core.cuda_architectures(), _core.cuda_architectures()
"""
NO_TOOLKIT_LOADED = """
    maps = [line.split()[-1] for line in open("/proc/self/maps") if "/" in line]
    assert not [m for m in maps if "cuda" in m.lower() and "site-packages" not in m], maps
"""

TORCH_ONLY = WHEEL + """
    import ctypes, importlib.util
    import groupgemm  # first: its CPU libraries must leave torch's symbols alone
    import torch
    import groupgemm.torch as gt
    assert importlib.util.find_spec("jax") is None, "this environment must not have jax"
    # libdnnl stays out of the global scope: its C++ standard-library instantiations took
    # the place of torch 2.6's own, whose TorchScript (forward AD loads it) then crashed.
    assert not hasattr(ctypes.CDLL(None), "dnnl_version")
    with torch.autograd.forward_ad.dual_level():
        torch.autograd.forward_ad.make_dual(torch.ones(2), torch.ones(2))
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    y = gt.grouped_mm(x, w, torch.tensor([2, 0, 3]))
    y.square().sum().backward()
    want = torch.cat([x[:2] @ w[0], x[2:5] @ w[2]]).detach()
    assert torch.allclose(y[:5].detach(), want) and (y[5] == 0).all()
    assert (w.grad[1] == 0).all() and (x.grad[5] == 0).all()
    assert torch.allclose(w.grad[0], 2 * x[:2].detach().T @ want[:2])
""" + NO_TOOLKIT_LOADED + """
    print(groupgemm.__version__, torch.__version__, groupgemm.cuda_compiled())
"""

JAX_ONLY = WHEEL + """
    import importlib.util
    import jax, jax.numpy as jnp, numpy as np
    import groupgemm, groupgemm.jax as gj
    assert importlib.util.find_spec("torch") is None, "this environment must not have torch"
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.float32)
    sizes = jnp.asarray([2, 0, 3], jnp.int32)
    y = jax.jit(gj.grouped_matmul)(x, w, sizes)
    dw = jax.jit(jax.grad(lambda w, s: jnp.sum(gj.grouped_matmul(x, w, s) ** 2)))(w, sizes)
    want = np.concatenate([np.asarray(x[:2]) @ np.asarray(w[0]), np.asarray(x[2:5]) @ np.asarray(w[2])])
    np.testing.assert_allclose(np.asarray(y[:5]), want, rtol=1e-5, atol=1e-5)
    assert (np.asarray(y[5]) == 0).all() and (np.asarray(dw[1]) == 0).all()
    np.testing.assert_allclose(np.asarray(dw[0]), 2 * np.asarray(x[:2]).T @ want[:2], rtol=1e-4, atol=1e-4)
""" + NO_TOOLKIT_LOADED + """
    print(groupgemm.__version__, jax.__version__, groupgemm.cuda_compiled())
"""


def run_in(variable, script):
    python = os.environ.get(variable)
    if not python:
        pytest.skip(f"{variable} is not set: ./dev.sh test builds that environment")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "XLA_FLAGS", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH")}
    env["PATH"] = "/usr/bin:/bin"  # no nvcc (this machine has a wrapper for it in /usr/local/bin)
    # Outside the checkout, so that the installed wheel is imported, not the sources.
    result = subprocess.run([python, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                            cwd=os.path.expanduser("~"), env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()


def test_torch_only_environment_runs_forward_and_backward():
    version, _, cuda = run_in("GROUPGEMM_TORCH_ONLY_PYTHON", TORCH_ONLY)
    assert version == __import__("groupgemm").__version__
    assert cuda == str(__import__("groupgemm").cuda_compiled())  # the wheel's core is the dev build's


def test_jax_only_environment_runs_a_jitted_grad():
    version, _, cuda = run_in("GROUPGEMM_JAX_ONLY_PYTHON", JAX_ONLY)
    assert version == __import__("groupgemm").__version__
    assert cuda == str(__import__("groupgemm").cuda_compiled())


@pytest.mark.parametrize("settings, env, want", [
    ({}, {}, True),
    ({}, {"GROUPGEMM_CUDA": "OFF"}, False),
    ({}, {"GROUPGEMM_CUDA": "0"}, False),
    ({"cmake.define.GROUPGEMM_CUDA": "OFF"}, {}, False),
    ({"cmake.define.GROUPGEMM_CUDA": "ON"}, {"GROUPGEMM_CUDA": "OFF"}, True),  # -C wins
])
def test_cuda_is_requested_unless_turned_off(settings, env, want, monkeypatch):
    monkeypatch.delenv("GROUPGEMM_CUDA", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert build_backend.cuda_requested(settings) is want


def test_a_module_built_on_a_prebuilt_core_needs_none_of_the_core_requirements(monkeypatch, tmp_path):
    monkeypatch.delenv("GROUPGEMM_CUDA", raising=False)
    monkeypatch.setenv("CUDACXX", str(tmp_path / "missing-nvcc"))
    assert build_backend.core_requirements({}) == list(build_backend.CPU_LIBRARIES)
    assert build_backend.core_requirements({"cmake.define.GROUPGEMM_PREBUILT_CORE": "/x/libgroupgemm_core.so"}) == []


def test_cutlass_headers_are_a_build_requirement_only_with_nvcc(monkeypatch, tmp_path):
    monkeypatch.delenv("GROUPGEMM_CUDA", raising=False)
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text("#!/bin/sh\n")
    fake_nvcc.chmod(0o755)
    monkeypatch.setenv("CUDACXX", str(fake_nvcc))
    assert build_backend._cuda_requirements({}) == [build_backend.CUTLASS_HEADERS]
    assert build_backend._cuda_requirements({"cmake.define.GROUPGEMM_CUDA": "OFF"}) == []
    monkeypatch.setenv("CUDACXX", str(tmp_path / "missing-nvcc"))
    assert build_backend.find_nvcc() is None and build_backend._cuda_requirements({}) == []
