"""The FP8 API in both frontends (one body each, the `frontend` fixture) against the float64
reference of its dequantized operands (helpers/fp8_reference.py), on the shared case table:
quantization bit for bit, the scaled GEMMs' two forms, the training recipe, bad input."""

import fp8_reference as fref
import frontends
import numpy as np
import pytest
import reference as ref
from bits import raw_bits
from cases import CASE_IDS, CASES, case, round_to
from fp8_bad_inputs import FP8_BAD_INPUTS, fp8_base_arguments
from fp8_reference import RECIPES, dims, inputs
from frontends import frontend  # noqa: F401 - the fixture


def as_f64(frontend, *arrays):
    return [None if a is None else frontend.to_float64(a) for a in arrays]


def assert_bits(actual, expected, what):
    actual, expected = raw_bits(actual), raw_bits(np.asarray(expected))
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    assert np.array_equal(actual, expected), f"{what}: {np.count_nonzero(actual != expected)} elements differ"


def offset_of(c):
    return c.group_offset


# ---- quantization ----------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "power_of_two"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16", "float16"])
def test_quantize_fp8_matches_the_reference_bit_for_bit(frontend, recipe, fp8_dtype, power_of_two, in_dtype):
    x = inputs(case("skewed"), in_dtype)
    x["x"][3, 5:40] = 0  # exact zeros stay zeros
    x["x"][4] = 0  # an all-zero row: scale 1
    x["x"][5, 7] = np.inf  # an infinite scale: the infinity quantizes to NaN, the rest of the block to 0
    x["x"][6, 9] = -np.nan  # a NaN scale: the whole block NaN (negative, as torch's cast to bfloat16 makes any NaN)
    x["w"][0, :, 200:] *= 2.0**-12  # tiny values next to large ones: float8 subnormals and below
    for operand in (round_to(x["x"], in_dtype), round_to(x["w"], in_dtype)):
        q, scale = frontend.quantize_fp8(frontend.array(operand, in_dtype), recipe, dtype=fp8_dtype,
                                         power_of_two=power_of_two)
        want_q, want_scale = fref.quantize(operand, recipe, fp8_dtype, power_of_two)
        assert_bits(q, want_q, "q")
        assert_bits(scale, want_scale, "scale")
        assert frontend.dtype_of(q) == fp8_dtype


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_quantize_fp8_grouped_matches_the_reference_and_zeroes_padding_rows(frontend, c, recipe):
    x = inputs(c)
    sizes = frontend.array(x["group_sizes"], "int32")
    q, scale = frontend.quantize_fp8_grouped(frontend.array(x["x"], "bfloat16"), sizes, recipe, num_groups=c.g,
                                             offset=offset_of(c))
    want_q, want_scale = fref.quantize_grouped(x["x"], x["group_sizes"], recipe, c.g, c.offset)
    assert_bits(q, want_q, "q")
    assert_bits(scale, want_scale, "scale")
    padding = ref.padding_rows(x["group_sizes"], c.m, c.g, c.offset)
    assert (frontend.to_float64(q)[:, padding] == 0).all()


def test_blockwise_token_blocks_restart_at_every_group():
    # Group sizes 130, 0, 3, 256: blocks [0, 128) [128, 130) | [130, 133) | [133, 261) [261, 389);
    # the bound (M + 127 G) // 128 covers any sizes.
    blocks = fref.token_blocks(np.array([130, 0, 3, 256]), 389, 4)
    assert [(b, e, row) for _, b, e, row in blocks] == [(0, 128, 0), (128, 130, 1), (130, 133, 2), (133, 261, 3),
                                                        (261, 389, 4)]
    from groupgemm import _contract

    assert _contract.fp8_token_block_bound(389, 4) == 7 >= len(blocks)


# ---- the forward / dgrad form ----------------------------------------------------------


@pytest.mark.parametrize("variant", [("bfloat16", False), ("float32", True)], ids=["bfloat16", "float32_bias"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_scaled_matmul_matches_the_float64_product_of_its_dequantized_operands(frontend, c, recipe, variant):
    out_dtype, with_bias = variant
    x = inputs(c)
    sizes = frontend.array(x["group_sizes"], "int32")
    qx, sx = frontend.quantize_fp8(frontend.array(x["x"], "bfloat16"), recipe)
    qw, sw = frontend.quantize_fp8(frontend.array(x["w"], "bfloat16"), recipe)
    bias = frontend.array(x["bias"], out_dtype) if with_bias else None
    out = frontend.scaled_matmul(qx, qw, sizes, sx, sw, recipe, bias=bias, offset=offset_of(c), out_dtype=out_dtype)
    qx, sx, qw, sw = as_f64(frontend, qx, sx, qw, sw)
    want = fref.scaled_matmul(fref.dequantize(qx, sx, recipe), fref.dequantize(qw, sw, recipe), x["group_sizes"],
                              x["bias"] if with_bias else None, c.offset)
    assert frontend.dtype_of(out) == out_dtype and tuple(out.shape) == (c.m, dims(c)[2])
    fref.assert_close(frontend.to_float64(out), want, out_dtype, c.name)
    assert (frontend.to_float64(out)[ref.padding_rows(x["group_sizes"], c.m, c.g, c.offset)] == 0).all()


def test_a_float8_e5m2_gradient_is_accepted_as_lhs(frontend):
    c = case("skewed")
    x = inputs(c)
    qx, sx = frontend.quantize_fp8(frontend.array(x["x"], "bfloat16"), "blockwise", dtype="float8_e5m2")
    qw, sw = frontend.quantize_fp8(frontend.array(x["w"], "bfloat16"), "blockwise")
    out = frontend.scaled_matmul(qx, qw, frontend.array(x["group_sizes"], "int32"), sx, sw, "blockwise")
    qx, sx, qw, sw = as_f64(frontend, qx, sx, qw, sw)
    want = fref.scaled_matmul(fref.dequantize(qx, sx, "blockwise"), fref.dequantize(qw, sw, "blockwise"),
                              x["group_sizes"])
    fref.assert_close(frontend.to_float64(out), want, "bfloat16")


# ---- the weight-gradient form ----------------------------------------------------------


def _wgrad_operands(frontend, c, recipe, x):
    sizes = frontend.array(x["group_sizes"], "int32")
    grouped = [frontend.quantize_fp8_grouped(frontend.array(x[k], "bfloat16"), sizes, recipe, num_groups=c.g,
                                             offset=offset_of(c)) for k in ("dout", "x")]
    return sizes, grouped


def _wgrad_reference(frontend, c, recipe, x, grouped):
    (qd, sd), (qx, sx) = ([frontend.to_float64(a) for a in pair] for pair in grouped)
    deq = [fref.dequantize_grouped(q, s, x["group_sizes"], recipe, c.g, c.offset) for q, s in ((qd, sd), (qx, sx))]
    return fref.scaled_wgrad(*deq, x["group_sizes"], c.g, c.offset)  # [G, N, K]


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_scaled_wgrad_matches_the_float64_product_and_zeroes_empty_groups(frontend, c, recipe, out_dtype):
    x = inputs(c)
    sizes, ((qd, sd), (qx, sx)) = _wgrad_operands(frontend, c, recipe, x)
    out = frontend.scaled_wgrad(qd, qx, sizes, sd, sx, recipe, num_groups=c.g, offset=offset_of(c),
                                out_dtype=out_dtype)
    want = _wgrad_reference(frontend, c, recipe, x, ((qd, sd), (qx, sx)))
    got = frontend.to_float64(out)
    assert got.shape == want.shape and frontend.dtype_of(out) == out_dtype
    fref.assert_close(got, want, out_dtype, c.name)
    for g in ref.empty_groups(x["group_sizes"], c.m, c.g, c.offset):
        assert (got[g] == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["middle_empty", "window_middle", "all_empty", "many_groups"])
def test_scaled_wgrad_accumulates_in_float32_and_keeps_empty_groups_bitwise(frontend, name, recipe):
    c = case(name)
    x = inputs(c)
    sizes, ((qd, sd), (qx, sx)) = _wgrad_operands(frontend, c, recipe, x)
    before = x["acc"][:, :, :]  # [G, N, K] float32
    acc = frontend.scaled_wgrad(qd, qx, sizes, sd, sx, recipe, num_groups=c.g, offset=offset_of(c),
                                accumulate_into=frontend.array(before, "float32"))
    after = frontend.to_float64(acc).astype(np.float32)
    want = before + _wgrad_reference(frontend, c, recipe, x, ((qd, sd), (qx, sx)))
    fref.assert_close(after, want, "float32", name)
    for g in ref.empty_groups(x["group_sizes"], c.m, c.g, c.offset):
        assert np.array_equal(after[g].view(np.int32), before[g].view(np.int32))


# ---- both ----------------------------------------------------------------------------


def test_the_same_call_gives_the_same_bits(frontend):
    c = case("many_groups")
    x = inputs(c)
    results = []
    for _ in range(2):
        sizes, ((qd, sd), (qx, sx)) = _wgrad_operands(frontend, c, "blockwise", x)
        q, s = frontend.quantize_fp8(frontend.array(x["x"], "bfloat16"), "blockwise")
        qw, sw = frontend.quantize_fp8(frontend.array(x["w"], "bfloat16"), "blockwise")
        results.append([raw_bits(frontend.scaled_matmul(q, qw, sizes, s, sw, "blockwise")),
                        raw_bits(frontend.scaled_wgrad(qd, qx, sizes, sd, sx, "blockwise", num_groups=c.g))])
    assert all(np.array_equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", [c for c in CASES if c.group_offset is None],
                         ids=[c.name for c in CASES if c.group_offset is None])
def test_torch_offs_gives_the_bits_of_the_group_sizes(c, recipe):
    # torch's offs (cumulative ends) is read by the core as the sizes it sums to, in both forms.
    torch = pytest.importorskip("torch")
    import groupgemm.torch as gt
    from groupgemm import _contract

    x = inputs(c)
    sizes = torch.from_numpy(np.asarray(x["group_sizes"], np.int32))
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    (qx, sx), (qw, sw) = (gt.quantize_fp8(torch.from_numpy(x[k]).bfloat16(), recipe) for k in ("x", "w"))
    a, b = _contract.torch_fp8_scalings("2d-3d", recipe)
    forward = [gt.scaled_grouped_mm(qx, qw.transpose(-2, -1), sx, a, sw, b, **groups)
               for groups in (dict(group_sizes=sizes), dict(offs=offs))]
    (qd, sd), (qxt, sxt) = (gt.quantize_fp8_grouped(torch.from_numpy(x[k]).bfloat16(), sizes, recipe)
                            for k in ("dout", "x"))
    a, b = _contract.torch_fp8_scalings("2d-2d", recipe)
    wgrad = [gt.scaled_grouped_mm(qd, qxt.t(), sd, a, sxt, b, **groups)
             for groups in (dict(group_sizes=sizes), dict(offs=offs))]
    for pair, what in ((forward, "2d x 3d"), (wgrad, "2d x 2d")):
        assert torch.equal(pair[0].view(torch.int16), pair[1].view(torch.int16)), what


def test_torch_offs_of_another_count_than_num_groups_is_named_before_the_scales():
    torch = pytest.importorskip("torch")
    import groupgemm.torch as gt

    sizes = torch.tensor([4, 4, 4], dtype=torch.int32)
    (qd, sd), (qx, sx) = (gt.quantize_fp8_grouped(torch.ones(12, width), sizes, "rowwise") for width in (16, 128))
    with pytest.raises(ValueError, match="scaled_grouped_mm: offs has 3 entries but there are 2 groups"):
        gt.scaled_grouped_mm(qd, qx.t(), sd, "RowWise", sx, "RowWise", offs=torch.cumsum(sizes, 0, dtype=torch.int32),
                             num_groups=2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_jax_vmap_of_the_fp8_calls_gives_each_entrys_bits(recipe):
    # vmap binds each primitive once with its batched operands flagged; the raw call maps
    # over the entries (partitioning.py), with the unbatched ones shared.
    jax = pytest.importorskip("jax")
    import groupgemm.jax as gj

    c = case("skewed")
    entries = [inputs(c, seed=seed) for seed in (0, 1)]
    xs = jax.numpy.stack([jax.numpy.asarray(e["x"], "bfloat16") for e in entries])
    w = jax.numpy.asarray(entries[0]["w"], "bfloat16")
    sizes = jax.numpy.asarray(entries[0]["group_sizes"], "int32")
    qw, sw = gj.quantize_fp8(w, recipe)

    def layer(x):
        q, s = gj.quantize_fp8(x, recipe)
        dq, ds = gj.quantize_fp8_grouped(x, sizes, recipe)
        return (gj.scaled_grouped_matmul(q, qw, sizes, s, sw, recipe=recipe),
                gj.scaled_grouped_matmul_wgrad(dq, dq, sizes, ds, ds, recipe=recipe))

    batched = jax.jit(jax.vmap(layer))(xs)
    for i, x in enumerate(xs):
        for got, want in zip(batched, layer(x)):
            assert_bits(np.asarray(got[i]), np.asarray(want), f"entry {i}")


@pytest.mark.parametrize("name, row", [(name, r) for r in FP8_BAD_INPUTS for name in r.frontends],
                         ids=[f"{name}-{r.id}" for r in FP8_BAD_INPUTS for name in r.frontends])
def test_fp8_bad_input_raises_naming_the_argument(name, row):
    frontend = frontends.load(name)
    with pytest.raises(row.error, match=row.message(frontend.FP8_NAMES)):
        row.call(frontend, fp8_base_arguments(frontend))


def test_fp8_ffi_handlers_are_registered_for_both_platforms():
    from groupgemm import _core

    handlers = _core.ffi_handlers()
    assert set(handlers["cpu"]) == set(handlers["CUDA"]) >= {
        "groupgemm_fp8_quantize_rows", "groupgemm_fp8_quantize_blocks", "groupgemm_fp8_quantize_grouped",
        "groupgemm_scaled_matmul", "groupgemm_scaled_wgrad"}


@pytest.mark.parametrize("change, error, match", [
    ({"rhs_type": "e5m2"}, ValueError, "rhs must be float8_e4m3fn"),
    ({"scaling": "blockwise", "k": 64}, ValueError, "K .* multiple of 128, got 64"),
    ({"out": "float16"}, ValueError, "output dtype must be bfloat16 or float32"),
    ({"lhs_scale": 5}, ValueError, "lhs_scale has 5 elements, expected 6"),
    ({"sizes": 2}, ValueError, "group_sizes has 2 entries but there are 3 groups"),
    ({"lhs_bytes": "bfloat16"}, TypeError, "lhs must be the uint8 bytes of a float8 array"),
])
def test_the_core_refuses_what_the_frontends_refuse(change, error, match):
    # The C++ checks behind the frontends' (the backstop for C++ callers), named in its own words.
    torch = pytest.importorskip("torch")
    from groupgemm import _core

    k = change.get("k", 128)
    lhs = torch.zeros(6, k, dtype=getattr(torch, change.get("lhs_bytes", "uint8")))
    out = torch.zeros(6, 8, dtype=getattr(torch, change.get("out", "bfloat16")))
    scaling = getattr(_core.Fp8Scaling, change.get("scaling", "rowwise"))
    scales = (torch.ones(change.get("lhs_scale", 6)), torch.ones(3, 8)) if scaling == _core.Fp8Scaling.rowwise else (
        torch.ones(6, 1), torch.ones(3, 1, 1))
    with pytest.raises(error, match=match):
        _core.scaled_grouped_matmul(lhs, torch.zeros(3, 8, k, dtype=torch.uint8), *scales,
                                    torch.tensor([2, 2, 2][:change.get("sizes", 3)], dtype=torch.int32), out=out,
                                    scaling=scaling, lhs_type=_core.Fp8Type.e4m3,
                                    rhs_type=getattr(_core.Fp8Type, change.get("rhs_type", "e4m3")))


def test_the_token_block_bound_is_the_cores_rule():
    from groupgemm import _contract as contract
    from groupgemm import _core

    for m in (-1, 0, 1, 127, 128, 129, 300, 4096):
        for g in (-1, 0, 1, 2, 3, 7, 64):
            assert contract.fp8_token_block_bound(m, g) == _core.fp8_token_block_bound(m, g), (m, g)


@pytest.mark.parametrize("recipe", RECIPES)
def test_torch_fp8_weight_gradient_functions_compile_with_fullgraph_and_give_the_eager_bits(recipe):
    torch = pytest.importorskip("torch")
    import groupgemm.torch as gt

    scaling = {"rowwise": "RowWise", "blockwise": "BlockWise1x128"}[recipe]

    def weight_gradient(x, dy, sizes):
        qx, sx = gt.quantize_fp8_grouped(x, sizes, recipe)
        qy, sy = gt.quantize_fp8_grouped(dy, sizes, recipe)
        flat = (lambda s: s.reshape(-1)) if recipe == "rowwise" else (lambda s: s)
        return gt.scaled_grouped_mm(qx, qy.t(), flat(sx), scaling, flat(sy), scaling, group_sizes=sizes,
                                    output_dtype=torch.float32)

    compiled = torch.compile(weight_gradient, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    x, dy = torch.randn(300, 128, generator=generator), torch.randn(300, 256, generator=generator)
    for sizes in ([140, 0, 160], [0, 0, 0]):
        sizes = torch.tensor(sizes)
        assert torch.equal(compiled(x, dy, sizes).view(torch.int32), weight_gradient(x, dy, sizes).view(torch.int32))
