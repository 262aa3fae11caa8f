"""The documentation holds: every ```python block of docs/ runs as written, and the API
reference (docs/api.md) documents every public name of the package's modules."""

import importlib
import inspect
import os
import re

import pytest
from clients import missing_extra, skip_for

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")
# A block that must not run here starts with this line, which says why (needs a GPU...).
NOT_RUN = re.compile(r"# not run here: \S")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = sorted(os.path.relpath(os.path.join(root, name), DOCS)
               for root, _, names in os.walk(DOCS) if "_build" not in root
               for name in names if name.endswith(".md"))
# The modules whose public names the reference must list, and where it lists them.
PUBLIC_MODULES = ("groupgemm", "groupgemm.jax", "groupgemm.flax", "groupgemm.torch",
                  "groupgemm.integrations.torchtitan", "groupgemm.integrations.megatron",
                  "groupgemm.integrations.transformers")
REFERENCED = re.compile(r"^\.\. auto(?:function|class):: ([\w.]+)", re.M)


def page_blocks(page):
    return BLOCK.findall(open(os.path.join(DOCS, page)).read())


@pytest.mark.parametrize("page", [p for p in PAGES if page_blocks(p)])
def test_docs_page_code_blocks_run_in_order(page):
    # A page's blocks share one namespace, as a reader runs them one after the other; a
    # block marked not run is still compiled, so it at least parses.
    namespace = {"__name__": f"docs.{page}"}
    for index, block in enumerate(page_blocks(page)):
        code = compile(block, f"docs/{page} block {index}", "exec")
        if not NOT_RUN.match(block):
            try:
                exec(code, namespace)
            except ImportError as error:  # an integration's client, on a machine without it
                if not missing_extra(error):
                    raise
                skip_for(error)


def test_docs_have_code_blocks_and_few_are_left_unrun():
    blocks = [b for p in PAGES for b in page_blocks(p)]
    marked = [b.splitlines()[0] for b in blocks if NOT_RUN.match(b)]
    assert len(blocks) >= 20
    assert len(marked) <= len(blocks) // 4, marked  # each says why, e.g. "needs a CUDA device"


def public_names(module_name):
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:  # groupgemm.flax, on a machine without flax
        if not missing_extra(error):
            raise
        skip_for(error)
    return [(module_name, name, getattr(module, name)) for name in module.__all__]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_has_a_docstring_and_a_reference_entry(module_name):
    referenced = set(REFERENCED.findall(open(os.path.join(DOCS, "api.md")).read()))
    for _, name, value in public_names(module_name):
        assert f"{module_name}.{name}" in referenced, f"{module_name}.{name} is missing from docs/api.md"
        doc = value.__dict__.get("__doc__") if inspect.isclass(value) else value.__doc__
        assert doc and doc.strip(), f"{module_name}.{name} has no docstring"


def test_every_public_module_defines_all_and_the_reference_lists_nothing_else():
    listed = {f"{m}.{n}" for module in PUBLIC_MODULES for m, n, _ in public_names(module)}
    referenced = set(REFERENCED.findall(open(os.path.join(DOCS, "api.md")).read()))
    assert referenced == listed, referenced ^ listed


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_attribute_of_a_module_is_in_its_all(module_name):
    # A name imported into a public module without being added to __all__ would escape
    # the reference: every public function or class there that groupgemm defines is in it.
    module = importlib.import_module(module_name)
    public = {name for name, value in vars(module).items()
              if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
              and getattr(value, "__module__", "").startswith("groupgemm")}
    assert public <= set(module.__all__), public - set(module.__all__)
