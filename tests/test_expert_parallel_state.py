"""ExpertParallelMoE's experts in its state dict: every rank holds other experts under the
same names, so the state dict gives them as DTensors over the group, and a distributed
checkpoint (torch.distributed.checkpoint) keeps every rank's, and their optimizer state
(optimizer_state_dict), with and without FSDP2 on the ranks that hold the same experts, and
loads into a group of one; FSDP2 over the group's own ranks is refused; under
DistributedDataParallel with the experts left out (the guide's recipe) each rank keeps its
experts and their gradients."""

import json
import os

import pytest
from workers import run_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "ep_state_worker.py")


def run(world, mode, out_dir):
    run_worker(WORKER, world, out_dir, mode, timeout=180)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.parametrize("world, mode, count", [(2, "plain", 18), (4, "fsdp", 5), (2, "ddp", 5)])
def test_each_rank_keeps_its_experts(world, mode, count, tmp_path):
    for rank, checked in enumerate(run(world, mode, tmp_path)):
        assert len(checked) == count, checked
        assert [name for name, held in checked.items() if held is not True] == [], f"rank {rank}: {checked}"


def test_fsdp_over_the_groups_own_ranks_is_refused_naming_the_parameter(tmp_path):
    # The forward sees the experts sharded where fully_shard is on them; with it on the
    # layer, FSDP2 has gathered them by then, and the state dict is where it shows.
    refusals = {"forward, experts": "ExpertParallelMoE", "state_dict, experts": "ExpertParallelMoE.state_dict",
                "state_dict, layer": "ExpertParallelMoE.state_dict"}
    for errors in run(2, "wrong-mesh", tmp_path):
        for where, name in refusals.items():
            assert errors[where] is not None and errors[where].startswith(
                f"{name}: experts.fc1.weight is sharded over ranks [0, 1] of the layer's expert-parallel group"), errors


@pytest.mark.parametrize("state, got", [({"param_groups": []}, r"a dict with keys \['param_groups'\]"),
                                        ([], "list")])
def test_a_state_that_is_not_an_optimizer_state_dict_is_refused(state, got):
    # Missing "state", torch would load the parameter groups and no moment, silently.
    import torch

    import groupgemm.torch as gt

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=f"load_optimizer_state_dict: state must be what optimizer_state_dict "
                                         f"returns, a dict with 'state' and 'param_groups', got {got}"):
        gt.load_optimizer_state_dict(model, torch.optim.Adam(model.parameters()), state)


@pytest.mark.parametrize("helper", ["optimizer_state_dict", "load_optimizer_state_dict"])
@pytest.mark.parametrize("swap, match", [
    ("model and optimizer swapped", "model must be a torch.nn.Module, got Adam"),
    ("no optimizer", "optimizer must be a torch.optim.Optimizer or an iterable of them, got NoneType"),
    ("options as a dict", "options must be a StateDictOptions or None, got dict"),
])
def test_the_state_helpers_name_an_argument_of_another_type(helper, swap, match):
    import torch

    import groupgemm.torch as gt

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    args = {"model and optimizer swapped": (optimizer, model), "no optimizer": (model, None),
            "options as a dict": (model, optimizer)}[swap]
    options = {"full_state_dict": True} if swap == "options as a dict" else None
    state = () if helper == "optimizer_state_dict" else ({"state": {}, "param_groups": []},)
    with pytest.raises(TypeError, match=f"{helper}: {match}"):
        getattr(gt, helper)(*args, *state, options)


def test_the_state_helpers_take_an_iterable_of_optimizers_as_torch_does():
    import torch

    import groupgemm.torch as gt

    model = torch.nn.Linear(2, 2)
    optimizers = {"one": torch.optim.Adam(model.parameters())}
    for given in ([optimizers["one"]], optimizers.values(), (o for o in optimizers.values())):
        assert gt.optimizer_state_dict(model, given)["param_groups"]
