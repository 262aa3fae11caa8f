"""The FP8 training recipe (groupgemm/_fp8_recipe.py) in both frontends: one grouped linear
layer's output and every gradient against the float64 reference of the recipe's
quantized operands, on the shared case table's group patterns; zero-token experts and
ranks; main_grad accumulation; no host sync under jit."""

import fp8_reference as fref
import numpy as np
import pytest
import reference as ref
from cases import case
from fp8_reference import LAYER_CASES, LAYER_K, LAYER_N, RECIPES, layer_inputs, recipe_reference
from frontends import frontend  # noqa: F401 - the fixture


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", LAYER_CASES, ids=[c.name for c in LAYER_CASES])
def test_fp8_layer_output_and_gradients_match_the_recipe_reference(frontend, c, recipe):
    x = layer_inputs(c)
    y, (dx, dw, db) = frontend.fp8_linear_and_grads(x["x"], x["w"], x["sizes"], x["bias"], x["dout"], recipe,
                                                    "bfloat16")
    y, dx, dw, db = (frontend.to_float64(a) for a in (y, dx, dw, db))
    for got, want, what in zip((y, dx, dw, db), recipe_reference(x, recipe, c.g), ("y", "dx", "dw", "dbias")):
        assert got.shape == want.shape, what
        fref.assert_close(got, want, "bfloat16", f"{c.name}/{what}")
    pad = ref.padding_rows(x["sizes"], c.m, c.g)
    assert (y[pad] == 0).all() and (dx[pad] == 0).all()
    for g in ref.empty_groups(x["sizes"], c.m, c.g):
        assert (dw[g] == 0).all() and (db[g] == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sizes", [[0, 0, 0], [5, 0, 3]], ids=["every_expert_empty", "one_expert_empty"])
@pytest.mark.parametrize("m", [0, 8], ids=["no_tokens", "tokens"])
def test_fp8_layer_with_zero_token_experts_gives_full_shape_exact_zero_gradients(frontend, recipe, sizes, m):
    c = case("uniform").__class__("zero", m, 0, 0, tuple(s if m else 0 for s in sizes))
    x = layer_inputs(c)
    y, grads = frontend.fp8_linear_and_grads(x["x"], x["w"], x["sizes"], x["bias"], x["dout"], recipe, "bfloat16")
    dx, dw, db = (frontend.to_float64(a) for a in grads)
    assert dx.shape == (m, LAYER_K) and dw.shape == (3, LAYER_N, LAYER_K) and db.shape == (3, LAYER_N)
    for g, size in enumerate(c.group_sizes):
        if size == 0:
            assert (dw[g] == 0).all() and (db[g] == 0).all()
    owned = sum(c.group_sizes)
    assert (frontend.to_float64(y)[owned:] == 0).all() and (dx[owned:] == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_main_grad_accumulation_adds_the_recipe_gradient_and_keeps_idle_experts_bitwise(recipe):
    torch_frontend = pytest.importorskip("torch_frontend")
    c = case("middle_empty")
    x = layer_inputs(c)
    before = np.random.default_rng(2).standard_normal((c.g, LAYER_N, LAYER_K)).astype(np.float32)
    _, (_, main_grad, _) = torch_frontend.fp8_linear_and_grads(x["x"], x["w"], x["sizes"], x["bias"], x["dout"],
                                                               recipe, "bfloat16", acc=before)
    after = main_grad.numpy()
    fref.assert_close(after, before + recipe_reference(x, recipe, c.g)[2], "float32")
    assert np.array_equal(after[1].view(np.int32), before[1].view(np.int32))  # expert 1 had no tokens


def test_fp8_mlp_compiles_with_fullgraph_and_gives_the_eager_bits():
    torch = pytest.importorskip("torch")
    import groupgemm.torch as gt

    torch.manual_seed(0)
    mlp = gt.GroupedMLP(4, 128, 128, fp8="blockwise", dtype=torch.bfloat16)
    compiled = torch.compile(lambda x, sizes: mlp(x, sizes), fullgraph=True)
    for sizes in ([10, 0, 20, 5], [0, 0, 0, 0]):
        results = []
        for run in (compiled, mlp):
            mlp.zero_grad()
            x = torch.randn(40, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
            x.requires_grad_()
            y = run(x, torch.tensor(sizes))
            y.float().square().sum().backward()
            results.append([y, x.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad])
        for a, b in zip(*results):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_jax_fp8_mlp_under_jit_compiles_once_for_any_routing():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import groupgemm.jax as gj

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((40, 128)), jnp.bfloat16)
    w_in, w_out = (jnp.asarray(rng.standard_normal(s) / 11, jnp.bfloat16) for s in ((4, 256, 128), (4, 128, 128)))
    traces = []

    @jax.jit
    def grads(sizes):
        traces.append(1)
        loss = lambda a, b: gj.grouped_mlp(x, a, b, sizes, transpose_rhs=True, fp8="blockwise").astype(
            jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(w_in, w_out)

    for sizes in ([10, 10, 10, 10], [40, 0, 0, 0], [0, 0, 0, 0], [1, 0, 30, 9]):
        g_in, g_out = grads(jnp.asarray(sizes, jnp.int32))
        for e in np.flatnonzero(np.asarray(sizes) == 0):
            assert (np.asarray(g_in[e]) == 0).all() and (np.asarray(g_out[e]) == 0).all()
    assert len(traces) == 1


def test_jax_fp8_mlp_refuses_a_derivative_of_its_gradient_saying_what_it_has():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import groupgemm.jax as gj

    x = jnp.ones((4, 128), jnp.bfloat16)
    w_in, w_out = jnp.full((2, 128, 256), 0.01, jnp.bfloat16), jnp.full((2, 128, 128), 0.01, jnp.bfloat16)
    loss = lambda x: gj.grouped_mlp(x, w_in, w_out, jnp.array([2, 2]), fp8="rowwise").astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"grouped_mlp\(fp8=...\) has a first derivative in reverse mode"):
        jax.grad(lambda x: jax.grad(loss)(x).astype(jnp.float32).sum())(x)


@pytest.mark.parametrize("hidden, ffn, name", [(128, 64, "F"), (100, 128, "H")])
def test_jax_blockwise_fp8_mlp_names_its_own_width_that_128_does_not_divide(hidden, ffn, name):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import groupgemm.jax as gj

    x, w_in, w_out = jnp.ones((4, hidden)), jnp.ones((2, hidden, 2 * ffn)), jnp.ones((2, ffn, hidden))
    with pytest.raises(ValueError, match=f"grouped_mlp: fp8='blockwise' needs {name} to be a multiple of 128 .*"
                                         f"got {ffn if name == 'F' else hidden}"):
        gj.grouped_mlp(x, w_in, w_out, jnp.array([2, 2]), fp8="blockwise")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["window_middle", "window_past_end", "window_outside"])
def test_jax_fp8_layer_of_an_expert_window_matches_the_recipe_reference(name, recipe):
    # Expert parallelism: the layer holds the window of experts from group_offset.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from groupgemm.jax_ext import fp8_recipe

    c = case(name)
    x = layer_inputs(c)
    params = {k: jnp.asarray(x[k], jnp.bfloat16) for k in ("x", "w", "bias")}
    f = lambda p: fp8_recipe.checked_fp8_grouped_matmul(p["x"], p["w"], jnp.asarray(x["sizes"]), bias=p["bias"],
                                                        transpose_rhs=True, group_offset=c.group_offset,
                                                        recipe=recipe, fn="grouped_mlp")
    y, vjp = jax.vjp(f, params)
    (grads,) = vjp(jnp.asarray(x["dout"], jnp.bfloat16))
    got = [np.asarray(a, np.float64) for a in (y, grads["x"], grads["w"], grads["bias"])]
    for g, want, what in zip(got, recipe_reference(x, recipe, c.g, c.offset), ("y", "dx", "dw", "dbias")):
        fref.assert_close(g, want, "bfloat16", f"{name}/{what}")
    assert (got[0][ref.padding_rows(x["sizes"], c.m, c.g, c.offset)] == 0).all()
