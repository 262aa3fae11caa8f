"""The two frontends behind one call surface (jax_frontend.py, torch_frontend.py), so one
test body serves both. Each adapter is imported only when a test asks for it: a JAX test
never imports torch, nor a PyTorch test jax."""

import importlib

import pytest

FRONTENDS = ["jax", "torch"]


def load(name):
    pytest.importorskip(name)
    return importlib.import_module(f"{name}_frontend")


@pytest.fixture(params=FRONTENDS)
def frontend(request):
    """Each test that takes `frontend` runs once per frontend."""
    return load(request.param)
