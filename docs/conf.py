"""Sphinx configuration of groupgemm's documentation (``./dev.sh docs``).

Sphinx with MyST Markdown, the pair JAX's and PyTorch's own documentation is built with:
autodoc renders the API reference from the docstrings the code carries (so the reference
cannot drift from the code; api.md lists each name itself, and tests/test_docs.py checks
that list is complete), and MyST keeps every page in Markdown, as the
README is. The theme is alabaster, Sphinx's default: one small pure-Python wheel.
``-W`` turns every warning (a broken cross-reference, a page outside the toctree, a
docstring that does not parse) into an error; ``./dev.sh test`` builds that way.
"""

project = "groupgemm"
copyright = "groupgemm authors"  # noqa: A001 - Sphinx's name for it
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links
myst_enable_extensions = ["colon_fence"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_title = "groupgemm"
html_theme_options = {"description": "Grouped GEMM for Mixture-of-Experts layers, in JAX and PyTorch",
                      "fixed_sidebar": True}
html_sidebars = {"**": ["about.html", "navigation.html", "searchbox.html"]}
