"""The test-only extras: the integrations' clients (torchtitan, megatron-core, transformers) and the
docs' tools. ./dev.sh setup installs them all, so CI runs every test that needs them;
on a machine that has only the project's own dependencies (a GPU machine with the copied
wheels) those tests skip with NOT_INSTALLED, a reason the GPU kit expects."""

import importlib

import pytest

NOT_INSTALLED = "is not installed here: ./dev.sh setup installs it"
EXTRAS = ("torchtitan", "megatron", "transformers", "flatbuffers", "sphinx", "myst_parser", "triton",
          "flax", "optax")


def require(module):
    """The imported module, or a skip of the calling test module naming it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} {NOT_INSTALLED}", allow_module_level=True)


def missing_extra(error):
    """Whether an ImportError is an extra's absence (then the test skips: skip_for)."""
    name = getattr(error, "name", None) or ""
    return name.split(".")[0] in EXTRAS


def skip_for(error):
    pytest.skip(f"{error.name} {NOT_INSTALLED}")
