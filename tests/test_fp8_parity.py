"""JAX and PyTorch give bitwise-identical FP8 results: one core computes both. Every case
of the shared table, both recipes: the quantized operands and scales, both GEMM forms
(accumulation included), and the training recipe's output and gradients."""

import jax_frontend
import pytest
import torch_frontend
from bits import assert_same_bits
from cases import CASE_IDS, CASES
from fp8_reference import LAYER_CASES, RECIPES, inputs, layer_inputs

FRONTENDS = (jax_frontend, torch_frontend)


def fp8_ops(frontend, c, recipe):
    """Every FP8 op's results on the case's inputs, named."""
    x = inputs(c)
    sizes = frontend.array(x["group_sizes"], "int32")
    qx, sx = frontend.quantize_fp8(frontend.array(x["x"], "bfloat16"), recipe)
    qw, sw = frontend.quantize_fp8(frontend.array(x["w"], "bfloat16"), recipe, power_of_two=True)
    grouped = [frontend.quantize_fp8_grouped(frontend.array(x[k], "bfloat16"), sizes, recipe, num_groups=c.g,
                                             offset=c.group_offset) for k in ("dout", "x")]
    (qd, sd), (qxt, sxt) = grouped
    wgrad = dict(num_groups=c.g, offset=c.group_offset)
    return {
        "q": qx, "scale": sx, "q_weight": qw, "scale_weight": sw, "q_grouped": qd, "scale_grouped": sd,
        "out": frontend.scaled_matmul(qx, qw, sizes, sx, sw, recipe, bias=frontend.array(x["bias"], "float32"),
                                      offset=c.group_offset, out_dtype="float32"),
        "wgrad": frontend.scaled_wgrad(qd, qxt, sizes, sd, sxt, recipe, **wgrad),
        "accumulated": frontend.scaled_wgrad(qd, qxt, sizes, sd, sxt, recipe, **wgrad,
                                             accumulate_into=frontend.array(x["acc"], "float32")),
    }


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_jax_and_torch_fp8_ops_are_bitwise_identical(c, recipe):
    jax_results, torch_results = (fp8_ops(f, c, recipe) for f in FRONTENDS)
    for name in jax_results:
        assert_same_bits(jax_results[name], torch_results[name], f"{c.name}/{recipe}/{name}")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", LAYER_CASES, ids=[c.name for c in LAYER_CASES])
def test_jax_and_torch_fp8_training_recipe_is_bitwise_identical(c, recipe):
    x = layer_inputs(c)
    results = [f.fp8_linear_and_grads(x["x"], x["w"], x["sizes"], x["bias"], x["dout"], recipe, "bfloat16")
               for f in FRONTENDS]
    (jax_y, jax_grads), (torch_y, torch_grads) = results
    assert_same_bits(jax_y, torch_y, f"{c.name}/{recipe}/y")
    for name, a, b in zip(("dx", "dw", "dbias"), jax_grads, torch_grads):
        assert_same_bits(a, b, f"{c.name}/{recipe}/{name}")
