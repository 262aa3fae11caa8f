"""The README's Python code blocks run as written."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
BLOCKS = re.findall(r"```python\n(.*?)```", open(README).read(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_code_block_runs(index):
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})


def test_readme_has_code_blocks():
    assert len(BLOCKS) >= 2
