"""groupgemm.integrations.torchtitan against torchtitan 0.3.0's own path (torch._grouped_mm):
the same bits where torch defines them, exact zeros where it leaves memory uninitialised.

Runs against the real torchtitan package, which ./dev.sh setup installs (pinned, without
its dependencies); bfloat16 throughout, as torchtitan's experts compute."""

import copy

import pytest
import torch
from clients import require

from groupgemm.integrations import torchtitan as integration
from groupgemm.integrations.torchtitan import experts_class, grouped_mm, use_groupgemm

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


def test_use_groupgemm_switches_every_experts_config_of_a_moe_layer_and_matches_it_bitwise():
    dim, hidden, experts, top_k = 32, 64, 8, 2
    config = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init={}, top_k=top_k, score_func="softmax"),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=hidden, num_experts=experts, top_k=top_k,
                                                  param_init={}, comm_backend="standard"))
    switched_config = use_groupgemm(copy.deepcopy(config))
    experts_configs = lambda: [c for _, c, _, _ in switched_config.traverse(titan_moe.GroupedExperts.Config)]
    switched = experts_configs()
    assert use_groupgemm(switched_config) is switched_config  # switching twice changes nothing
    again = experts_configs()
    assert len(again) == len(switched) > 0 and all(a is b for a, b in zip(again, switched))
    titan, ours = config.build(), switched_config.build()
    assert type(ours.routed_experts.inner_experts).__name__ == "GroupGemmGroupedExperts"
    assert type(titan.routed_experts.inner_experts) is titan_moe.GroupedExperts
    torch.manual_seed(0)
    with torch.no_grad():
        for p in titan.parameters():
            p.normal_(0, 0.2)
        titan.expert_bias_E[:3] = -1e4  # experts 0-2 never chosen
    ours.load_state_dict(titan.state_dict())
    x = torch.randn(2, 8, dim)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = titan(x1), ours(x2)
    y1.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    for (name, p1), p2 in zip(titan.named_parameters(), ours.parameters()):
        assert torch.equal(p1.grad, p2.grad), name
    assert (ours.routed_experts.inner_experts.w2_EDF.grad[:3] == 0).all()


def test_experts_class_refuses_a_class_without_the_seam():
    with pytest.raises(TypeError, match="experts_cls"):
        experts_class(torch.nn.Linear)
