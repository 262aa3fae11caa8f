"""groupgemm.integrations.torchtitan against torchtitan 0.3.0's own path (torch._grouped_mm):
the same bits where torch defines them, exact zeros where it leaves memory uninitialised.

Runs against the real torchtitan package, which ./dev.sh setup installs (pinned, without
its dependencies); bfloat16 throughout, as torchtitan's experts compute."""

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from clients import require
from workers import run_worker

from groupgemm.integrations import torchtitan as integration
from groupgemm.integrations.torchtitan import (
    experts_class,
    grouped_mm,
    token_dispatcher_class,
    use_groupgemm,
    use_groupgemm_dispatch,
)

titan_moe = require("torchtitan.models.common.moe")
config_utils = require("torchtitan.models.common.config_utils")
make_moe_config, make_routed_experts_config, make_router_config = (
    config_utils.make_moe_config, config_utils.make_routed_experts_config, config_utils.make_router_config)

DIM, HIDDEN, EXPERTS = 16, 32, 4


def _experts(seed=0):
    config = titan_moe.GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS)
    plain = config.build()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.2)
    switched = experts_class(titan_moe.GroupedExperts)(config)
    switched.load_state_dict(plain.state_dict())
    return plain, switched


@pytest.mark.parametrize("counts", [[4, 0, 6, 0], [3, 3, 3, 3], [0, 0, 10, 0]], ids=str)
def test_switched_experts_match_torchtitans_path_bitwise_and_zero_the_padding_rows(counts):
    plain, switched = _experts()
    counts = torch.tensor(counts)
    routed = int(counts.sum())
    x = torch.randn(routed + 3, DIM)                     # three padding rows past offs[-1]
    dy = torch.randn(routed + 3, DIM)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = plain(x1, counts), switched(x2, counts)
    (y1[:routed] * dy[:routed]).sum().backward()         # torch's padding rows hold garbage: leave them out
    (y2 * dy).sum().backward()
    assert torch.equal(y1[:routed], y2[:routed]) and torch.equal(x1.grad[:routed], x2.grad[:routed])
    assert (y2[routed:] == 0).all() and (x2.grad[routed:] == 0).all()
    for (name, p1), p2 in zip(plain.named_parameters(), switched.parameters()):
        assert torch.equal(p1.grad, p2.grad), name
        idle = counts == 0
        assert (p2.grad[idle] == 0).all(), name           # exact zeros for experts without tokens


def test_a_rank_with_every_expert_empty_gets_zero_output_and_full_zero_gradients():
    _, switched = _experts()
    x = torch.randn(5, DIM, requires_grad=True)
    out = switched(x, torch.zeros(EXPERTS, dtype=torch.int64))
    out.sum().backward()
    assert (out == 0).all() and (x.grad == 0).all()
    for p in switched.parameters():
        assert p.grad.shape == p.shape and (p.grad == 0).all()


def test_the_seam_reads_torchtitans_transposed_weight_in_place(monkeypatch):
    # B_t is a transposed view of a contiguous [E, N, K] weight, as GroupedExperts passes it:
    # groupgemm gets the weight itself with transpose_weight=True, no copy.
    seen = []
    weight = torch.randn(EXPERTS, HIDDEN, DIM, dtype=torch.bfloat16)

    def spy(*args, **kwargs):
        seen.append((args[1].data_ptr(), args[1].is_contiguous(), kwargs.get("transpose_weight", False)))
        return torch.zeros(args[0].shape[0], HIDDEN, dtype=args[0].dtype)

    monkeypatch.setattr(integration, "_grouped_mm", spy)
    grouped_mm(A=torch.randn(6, DIM, dtype=torch.bfloat16), B_t=weight.transpose(-2, -1),
               offs=torch.tensor([2, 2, 6, 6], dtype=torch.int32))
    assert seen == [(weight.data_ptr(), True, True)]


def _moe_config(dim=32, hidden=64, experts=8, top_k=2):
    return make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init={}, top_k=top_k, score_func="softmax"),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=hidden, num_experts=experts, top_k=top_k,
                                                  param_init={}, comm_backend="standard"))


def _run_side_by_side(config, switched_config, dim=32):
    """Both layers on the same weights (experts 0-2 never chosen) and tokens: their
    outputs, input gradients and named parameter gradients."""
    titan, ours = config.build(), switched_config.build()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in titan.parameters():
            p.normal_(0, 0.2)
        titan.expert_bias_E[:3] = -1e4
    ours.load_state_dict(titan.state_dict())
    results = []
    for layer in (titan, ours):
        x = torch.randn(2, 8, dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        results.append((y, x.grad, dict(layer.named_parameters())))
    return titan, ours, results


def test_use_groupgemm_switches_every_experts_config_of_a_moe_layer_and_matches_it_bitwise():
    config = _moe_config()
    switched_config = use_groupgemm(copy.deepcopy(config))
    experts_configs = lambda: [c for _, c, _, _ in switched_config.traverse(titan_moe.GroupedExperts.Config)]
    switched = experts_configs()
    assert use_groupgemm(switched_config) is switched_config  # switching twice changes nothing
    again = experts_configs()
    assert len(again) == len(switched) > 0 and all(a is b for a, b in zip(again, switched))
    titan, ours, ((y1, dx1, params1), (y2, dx2, params2)) = _run_side_by_side(config, switched_config)
    assert type(ours.routed_experts.inner_experts).__name__ == "GroupGemmGroupedExperts"
    assert type(titan.routed_experts.inner_experts) is titan_moe.GroupedExperts
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    for name, p1 in params1.items():
        assert torch.equal(p1.grad, params2[name].grad), name
    assert (ours.routed_experts.inner_experts.w2_EDF.grad[:3] == 0).all()


def test_use_groupgemm_dispatch_switches_the_token_dispatcher_and_matches_torchtitans_local_path():
    # Without an expert-parallel mesh the dispatcher only permutes, with the core's ops.
    config = _moe_config()
    switched_config = use_groupgemm_dispatch(copy.deepcopy(config), capacity=None)
    dispatcher_cls = token_dispatcher_class()
    configs = [c for _, c, _, _ in switched_config.traverse(dispatcher_cls.Config)]
    assert len(configs) == 1 and configs[0].num_experts == 8 and configs[0].top_k == 2
    assert use_groupgemm_dispatch(switched_config) is switched_config
    _, ours, ((y1, dx1, params1), (y2, dx2, params2)) = _run_side_by_side(config, switched_config)
    assert type(ours.routed_experts.token_dispatcher) is dispatcher_cls
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx2, dx1, rtol=1e-5, atol=1e-6)
    for name, p1 in params1.items():
        torch.testing.assert_close(params2[name].grad, p1.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert (params2["routed_experts.inner_experts.w2_EDF"].grad[:3] == 0).all()


def test_use_groupgemm_dispatch_refuses_a_dispatcher_that_drops_tokens_by_its_own_rule():
    # HybridEP's non_blocking_capacity_factor drops tokens; switching it silently would make
    # the model dropless. Unset, the config switches.
    hybrid = require("torchtitan.models.common.token_dispatcher").HybridEPTokenDispatcher.Config
    with pytest.raises(NotImplementedError, match="HybridEPTokenDispatcher.Config.non_blocking_capacity_factor = "
                                                  "0.5 drops tokens .* pass capacity="):
        use_groupgemm_dispatch(hybrid(num_experts=8, top_k=2, non_blocking_capacity_factor=0.5))
    switched = use_groupgemm_dispatch(hybrid(num_experts=8, top_k=2, pad_multiple=16), capacity=3)
    assert type(switched) is token_dispatcher_class().Config and switched.capacity == 3


def test_the_dispatchers_combine_returns_the_tokens_dtype():
    # As torchtitan's dispatchers return it (zeros_like(x)): experts in bfloat16 under
    # float32 tokens give float32 tokens back (each token's sum rounded to bfloat16 first).
    dispatcher = token_dispatcher_class()(token_dispatcher_class().Config(num_experts=4, top_k=2))
    x = torch.randn(5, DIM)
    ids, scores = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]]), torch.rand(5, 2)
    rows, _, metadata = dispatcher.dispatch(x, scores, ids, None)
    out = dispatcher.combine(rows.to(torch.bfloat16), metadata, x)
    assert out.dtype == torch.float32
    want = (rows.to(torch.bfloat16).float()[metadata[0].long()] * scores[..., None]).sum(1)
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


def test_experts_class_refuses_a_class_without_the_seam():
    with pytest.raises(TypeError, match="experts_cls"):
        experts_class(torch.nn.Linear)


def test_groupgemm_token_dispatcher_matches_torchtitans_all_to_all_over_two_ranks(tmp_path):
    # Two gloo processes run torchtitan's AllToAllTokenDispatcher and groupgemm's (dropless,
    # and with a capacity that drops nothing) on the same tokens and experts; at step 1 no
    # token goes to rank 1's experts. Rows, outputs and weight gradients are the same bits;
    # the score gradients are dot products whose order differs.
    require("torchtitan.models.common.token_dispatcher")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "torchtitan_ep_worker.py")
    run_worker(worker, tmp_path)
    for rank in range(2):
        saved = np.load(tmp_path / f"rank{rank}.npz")
        for mode in ("groupgemm dropless", "groupgemm capacity"):
            for step in range(2):
                theirs = lambda what: saved[f"torchtitan/{step}/{what}"]
                ours = lambda what: saved[f"{mode}/{step}/{what}"]
                for what in ("out", "dx", "dweights"):
                    assert np.array_equal(ours(what), theirs(what)), (rank, mode, step, what)
                np.testing.assert_allclose(ours("dscores"), theirs("dscores"), rtol=1e-5, atol=1e-5)
            idle = saved[f"{mode}/1/dweights"]
            assert (idle == 0).all() if rank == 1 else idle.any(axis=(1, 2)).all(), (rank, mode)


def test_a_switched_model_and_its_config_pickle_and_load_in_a_fresh_process(tmp_path):
    # The switched classes are made at run time; pickle finds them by name in the
    # integration's module, where a fresh process makes them again.
    config = use_groupgemm_dispatch(use_groupgemm(_moe_config()))
    model = config.build()
    with torch.no_grad():
        for p in model.parameters():  # built uninitialized (param_init={})
            p.normal_(0, 0.2)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "model.pt"
    torch.save({"config": config, "model": model, "x": x, "y": model(x).detach()}, path)
    code = ("import sys, torch; saved = torch.load(sys.argv[1], weights_only=False); model = saved['model']; "
            "names = lambda m: (type(m.routed_experts.inner_experts).__name__, "
            "type(m.routed_experts.token_dispatcher).__name__); "
            "assert names(model) == names(saved['config'].build()) == ('GroupGemmGroupedExperts', "
            "'GroupgemmTokenDispatcher'), names(model); "
            "assert torch.equal(model(saved['x']), saved['y']); print('loaded')")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr[-3000:]
