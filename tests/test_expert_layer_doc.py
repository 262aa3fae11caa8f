"""docs/expert-layer.md: its Python code blocks run in order, as a reader runs them."""

import os
import re

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "expert-layer.md")
BLOCKS = re.findall(r"^```python\n(.*?)^```", open(DOC).read(), re.S | re.M)


def test_expert_layer_page_code_blocks_run_in_order():
    assert len(BLOCKS) >= 5
    namespace = {"__name__": "docs.expert_layer"}
    for index, block in enumerate(BLOCKS):
        exec(compile(block, f"docs/expert-layer.md block {index}", "exec"), namespace)
