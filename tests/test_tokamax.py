"""groupgemm.jax.tokamax_implementation inside tokamax.ragged_dot (tokamax 0.0.12): values
and gradients against float64 NumPy, an empty group's weight gradient exactly zero, the
keyword arguments tokamax passes taken, and NotImplementedError naming the argument for
what groupgemm does not compute, after which tokamax falls through to the next
implementation.

tokamax 0.0.12 pins typeguard 2.13.3, which torchtitan's tyro (typeguard 4) excludes from
this environment: ./dev.sh installs tokamax's into a folder of its own
(``.venv/tokamax-typeguard``), and tokamax runs in a process with that folder first on
the path (helpers/tokamax_worker.py computes, these tests check)."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest
from clients import NOT_INSTALLED
from workers import run_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "tokamax_worker.py")
TYPEGUARD = os.path.join(sys.prefix, "tokamax-typeguard")
TOKAMAX_VERSION = "0.0.12"  # the release whose calls the adapter was written against: check a new one again


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(arrays, report) of one worker run."""
    if importlib.util.find_spec("tokamax") is None:
        pytest.skip(f"tokamax {NOT_INSTALLED}")
    out = tmp_path_factory.mktemp("tokamax")
    env = dict(os.environ)
    if os.path.isdir(TYPEGUARD):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (TYPEGUARD, env.get("PYTHONPATH")) if p)
    run_worker(WORKER, out, timeout=180, env=env)
    return dict(np.load(out / "results.npz")), json.load(open(out / "report.json"))


def reference(lhs, rhs, sizes, dout=None):
    """float64 (out, dlhs, drhs) of a ragged dot with dout the incoming gradient: rows of
    group g from offset(g), clipped to the rows there are; other rows 0."""
    lhs, rhs = lhs.astype(np.float64), rhs.astype(np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    dlhs, drhs = np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(min(start, lhs.shape[0]), min(start + max(size, 0), lhs.shape[0]))
        out[rows] = lhs[rows] @ rhs[g]
        if dout is not None:
            dlhs[rows] = dout[rows].astype(np.float64) @ rhs[g].T
            drhs[g] = lhs[rows].T @ dout[rows].astype(np.float64)
        start += max(size, 0)
    return out, dlhs, drhs


def case(arrays, name):
    return {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(name + "/")}


def test_the_worker_ran_tokamax_of_the_stated_version(worker):
    assert worker[1]["tokamax"] == TOKAMAX_VERSION


@pytest.mark.parametrize("name, tolerance", [("empty_groups", 1e-5), ("empty_groups_bf16", 2e-2),
                                             ("all_empty", 0)])
def test_empty_groups_get_exact_zero_weight_gradients_and_values_match_float64(worker, name, tolerance):
    arrays, report = worker
    got = case(arrays, name)
    sizes = got["group_sizes"]
    assert report["ran_groupgemm"][name]  # groupgemm computed it, not the "xla" after it
    want = reference(got["lhs"], got["rhs"], sizes, got["dout"])
    for label, w in zip(("out", "dlhs", "drhs"), want):
        np.testing.assert_allclose(got[label], w, rtol=tolerance, atol=tolerance, err_msg=f"{name} {label}")
    empty = np.flatnonzero(sizes == 0)
    assert len(empty) and (got["drhs"][empty] == 0).all()  # exact zeros, not merely small
    padding = slice(int(sizes.sum()), None)
    assert (got["out"][padding] == 0).all() and (got["dlhs"][padding] == 0).all()


def test_ragged_dot_general_modes_and_group_sizes_objects_match_float64(worker):
    arrays, _ = worker
    got = case(arrays, "general")
    out, _, _ = reference(got["lhs"], got["rhs"], got["group_sizes"])
    np.testing.assert_allclose(arrays["group_sizes_object/out"], out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(arrays["transposed_rhs/out"], out, rtol=1e-5, atol=1e-5)
    # The weight-gradient form lhs^T @ dout per group: the reference's drhs with dout.
    _, _, drhs = reference(got["lhs"], got["rhs"], got["group_sizes"], got["dout"])
    np.testing.assert_allclose(arrays["weight_gradient/out"], drhs, rtol=1e-5, atol=1e-5)
    assert (arrays["weight_gradient/out"][1] == 0).all()


def test_activation_output_dtype_and_precision_arguments_are_taken(worker):
    arrays, _ = worker
    got = case(arrays, "activation")
    out, _, _ = reference(got["lhs"], got["rhs"], got["group_sizes"])
    gelu = 0.5 * out * (1 + np.tanh(np.sqrt(2 / np.pi) * (out + 0.044715 * out**3)))  # jax.nn.gelu's default
    np.testing.assert_allclose(got["out"], gelu, rtol=1e-5, atol=1e-5)  # in float32, before any rounding
    assert got["out"].dtype == np.float32 and (got["drhs"][[0, 2, 4]] == 0).all()
    options = case(arrays, "options")
    out, _, _ = reference(options["lhs"], options["rhs"], options["group_sizes"])
    np.testing.assert_allclose(arrays["bf16_output/out"], out, rtol=1e-2, atol=1e-2)
    precisions = [k for k in arrays if k.startswith("precision ")]
    assert len(precisions) == 3
    for key in precisions:
        np.testing.assert_allclose(arrays[key], out, rtol=1e-5, atol=1e-5, err_msg=key)


def test_float16_with_bfloat16_is_computed_and_returned_in_float32(worker):
    got = case(worker[0], "mixed")
    out, _, _ = reference(got["lhs"], got["rhs"], got["group_sizes"])
    assert got["out"].dtype == np.float32
    np.testing.assert_allclose(got["out"], out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argument", ["lhs", "rhs", "precision", "precision:name", "precision:algorithm",
                                      "ragged_dot_dimension_numbers", "return_residuals"])
def test_what_groupgemm_does_not_compute_raises_not_implemented_naming_it_and_tokamax_falls_through(worker,
                                                                                                   argument):
    report = worker[1]
    kind, message = report["errors"][argument]
    name = argument.split(":")[0]
    assert kind == "NotImplementedError" and message.startswith(f"tokamax_implementation: {name} "), message
    if argument == "precision:algorithm":  # the value as given, not one of its fields
        assert message.startswith("tokamax_implementation: precision DotAlgorithm("), message
    if argument in report["fell_through"]:
        assert report["fell_through"][argument]  # [groupgemm, "xla"] gave xla's result


def test_a_precision_jax_does_not_know_gets_jaxs_error(worker):
    kind, message = worker[1]["errors"]["precision:invalid"]
    assert kind == "ValueError" and "Precision argument must be one of" in message, message


def test_the_guides_tokamax_example_runs(worker):
    assert worker[1]["guide_blocks_run"] >= 1
