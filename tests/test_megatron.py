"""groupgemm.integrations.megatron's builders in megatron-core 0.19.2's TEGroupedMLP, against
Megatron-core's own SequentialMLP (one MLP per expert, torch's GEMMs): the same bits in
bfloat16, forward, input gradient and weight gradients (into main_grad with
gradient_accumulation_fusion), zero-token experts and a rank with no tokens included.

Runs against the real megatron-core package, which ./dev.sh setup installs (pinned, without
its dependencies), in this process with a one-rank gloo group."""

import contextlib
import os
import pickle
import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from clients import require
from workers import run_worker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    require("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

from groupgemm.integrations.megatron import (
    ColumnParallelGroupedLinear,
    RowParallelGroupedLinear,
    token_dispatcher_class,
    use_groupgemm_dispatcher,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
EXPERTS, HIDDEN, FFN = 4, 16, 32
LOCAL_EXPERTS = 2  # of helpers/megatron_ep_worker.py's 4 experts on each of its 2 ranks


@pytest.fixture(scope="module")
def process_groups(tmp_path_factory):
    store = os.path.join(tmp_path_factory.mktemp("megatron"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield ProcessGroupCollection.use_mpu_process_groups()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _config(**options):
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, ffn_hidden_size=FFN,
                             moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, gated_linear_unit=True,
                             activation_func=torch.nn.functional.silu, add_bias_linear=False,
                             bias_activation_fusion=False, params_dtype=torch.bfloat16, bf16=True,
                             use_cpu_initialization=True, **options)


def _pair(process_groups, fusion):
    """Megatron's SequentialMLP and TEGroupedMLP on groupgemm's builders, with the same weights."""
    torch.manual_seed(0)
    reference = SequentialMLP(EXPERTS, _config(), MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear),
                              pg_collection=process_groups)
    experts = TEGroupedMLP(EXPERTS, _config(gradient_accumulation_fusion=fusion),
                           GroupedMLPSubmodules(linear_fc1=ColumnParallelGroupedLinear,
                                                linear_fc2=RowParallelGroupedLinear),
                           pg_collection=process_groups)
    with torch.no_grad():
        for name in ("linear_fc1", "linear_fc2"):
            getattr(experts, name).weight.copy_(torch.stack([getattr(e, name).weight for e in reference.local_experts]))
    if fusion:  # as Megatron-core's DistributedDataParallel leaves each parameter
        for p in experts.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.grad_added_to_main_grad = False
    return reference, experts


@pytest.mark.parametrize("fusion", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("counts", [[4, 0, 6, 0], [3, 3, 3, 1], [0, 0, 0, 0]], ids=str)
def test_builders_match_megatrons_sequential_mlp_bitwise(process_groups, counts, fusion):
    reference, experts = _pair(process_groups, fusion)
    counts = torch.tensor(counts)
    tokens = int(counts.sum())
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
    probs = torch.rand(tokens)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, _ = reference(x1, counts, probs)
    y2, _ = experts(x2, counts, probs)
    dy = torch.randn(tokens, HIDDEN)
    (y1.float() * dy).sum().backward()
    (y2.float() * dy).sum().backward()
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    for name in ("linear_fc1", "linear_fc2"):
        # Megatron's per-expert layers get no .grad at all when the rank has no tokens.
        want = torch.stack([torch.zeros_like(e.weight) if e.weight.grad is None else e.weight.grad
                            for e in (getattr(m, name) for m in reference.local_experts)])
        weight = getattr(experts, name).weight
        got = weight.main_grad.to(torch.bfloat16) if fusion else weight.grad
        assert got.shape == weight.shape and torch.equal(got, want), name
        assert (got[counts == 0] == 0).all(), name
        if fusion:
            assert weight.grad_added_to_main_grad is True


def test_main_grad_of_experts_without_tokens_is_left_bit_for_bit(process_groups):
    _, experts = _pair(process_groups, fusion=True)
    for p in experts.parameters():
        p.main_grad.normal_()
    before = [p.main_grad.clone() for p in experts.parameters()]
    counts = torch.tensor([5, 0, 0, 2])
    out, _ = experts(torch.randn(7, HIDDEN, dtype=torch.bfloat16), counts, torch.rand(7))
    out.float().sum().backward()
    for p, b in zip(experts.parameters(), before):
        assert torch.equal(p.main_grad[1:3].view(torch.int32), b[1:3].view(torch.int32))
        assert not torch.equal(p.main_grad[0], b[0])


def test_builders_give_megatron_its_parameter_attributes(process_groups):
    _, experts = _pair(process_groups, fusion=False)
    fc1, fc2 = experts.linear_fc1.weight, experts.linear_fc2.weight
    assert fc1.shape == (EXPERTS, 2 * FFN, HIDDEN) and fc2.shape == (EXPERTS, HIDDEN, FFN)
    assert fc1.dtype == torch.bfloat16 and fc1.allreduce and fc2.allreduce  # no expert parallelism here
    assert (fc1.tensor_model_parallel, fc1.partition_dim) == (True, 1)
    assert (fc2.tensor_model_parallel, fc2.partition_dim) == (True, 2)
    experts.backward_dw()  # TEGroupedMLP calls it on both layers: nothing deferred, nothing to do


@pytest.mark.parametrize("option", ["delay_wgrad_compute", "fp8", "use_kitchen", "quant_recipe"])
def test_builders_refuse_options_they_do_not_implement(process_groups, option):
    from megatron.core.quantization.utils import kitchen_quantization_recipe_config

    config = _config()
    # set after construction: TransformerConfig's own checks need TE (or kitchen) for these
    setattr(config, option, {"fp8": "hybrid", "quant_recipe": kitchen_quantization_recipe_config(1)}.get(option, True))
    with pytest.raises(NotImplementedError, match=f"config.{option}"):
        ColumnParallelGroupedLinear(EXPERTS, HIDDEN, FFN, config=config, init_method=torch.nn.init.zeros_,
                                    bias=False, skip_bias_add=False, is_expert=True, pg_collection=process_groups,
                                    name="decoder.layers.0.mlp.experts.linear_fc1")


def test_a_quant_recipe_that_leaves_the_experts_out_is_accepted(process_groups):
    from megatron.core.quantization.quant_config import GlobMatcher, RecipeConfig

    config = _config()
    config.quant_recipe = RecipeConfig(matchers=[GlobMatcher(pattern="*self_attention*", config_key="attention")],
                                       config_dict={"attention": {"kitchen_config_type": "QLinearParams",
                                                                  "recipe_idx": 1}})
    ColumnParallelGroupedLinear(EXPERTS, HIDDEN, FFN, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                skip_bias_add=False, is_expert=True, pg_collection=process_groups,
                                name="decoder.layers.0.mlp.experts.linear_fc1")


def test_gpu_expert_weights_are_drawn_under_megatrons_expert_parallel_random_stream(monkeypatch):
    # Megatron-core's expert layers draw their weights under the tracker's expert-parallel
    # stream (seeded per expert-parallel rank); weights made on the CPU are drawn from the
    # default generator, as in Megatron-core's CPU path, which that stream does not reach.
    from megatron.core.tensor_parallel import random as megatron_random

    from groupgemm.integrations import megatron as integration

    forks = []

    class Tracker:
        def is_initialized(self):
            return True

        @contextlib.contextmanager
        def fork(self, name):
            forks.append(name)
            yield

    monkeypatch.setattr(megatron_random, "get_cuda_rng_tracker", Tracker)
    with integration._expert_rng(types.SimpleNamespace(device=torch.device("cuda"))):
        pass
    with integration._expert_rng(torch.empty(1)):
        pass
    assert forks == [megatron_random.get_expert_parallel_rng_tracker_name()]


def test_builders_draw_every_expert_weight_inside_the_expert_random_stream(process_groups, monkeypatch):
    from groupgemm.integrations import megatron as integration

    events = []

    @contextlib.contextmanager
    def stream(weight):
        events.append(("enter", tuple(weight.shape)))
        yield
        events.append(("exit", None))

    monkeypatch.setattr(integration, "_expert_rng", stream)
    ColumnParallelGroupedLinear(EXPERTS, HIDDEN, FFN, config=_config(), bias=False, skip_bias_add=False,
                                init_method=lambda w: events.append(("draw", tuple(w.shape))), is_expert=True,
                                pg_collection=process_groups)
    assert events == [("enter", (EXPERTS, FFN, HIDDEN)), *[("draw", (FFN, HIDDEN))] * EXPERTS, ("exit", None)]


def test_distributed_checkpointing_is_refused_not_silently_wrong(process_groups):
    _, experts = _pair(process_groups, fusion=False)
    with pytest.raises(NotImplementedError, match="distributed checkpointing"):
        experts.sharded_state_dict()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """What helpers/megatron_ep_worker.py saved, per rank: two gloo processes
    (expert-parallel size 2) over two steps, at step 1 no token for rank 1's experts."""
    out_dir = tmp_path_factory.mktemp("megatron_ep")
    run_worker(os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "megatron_ep_worker.py"), out_dir)
    return [np.load(out_dir / f"rank{rank}.npz") for rank in range(2)]


def test_groupgemm_token_dispatcher_matches_megatrons_all_to_all_over_two_ranks(two_rank_results):
    # Megatron's MoEAlltoAllTokenDispatcher and groupgemm's (dropless, and with a capacity
    # that drops nothing) through MoELayer's six steps on the same tokens, routing and
    # experts: the rows and probs each expert gets, the outputs and every gradient are the
    # same bits.
    for rank, saved in enumerate(two_rank_results):
        for mode in ("groupgemm dropless", "groupgemm capacity"):
            for step in range(2):
                for what in ("rows", "row_probs", "out", "dx", "dprobs", "dweights"):
                    ours, theirs = saved[f"{mode}/{step}/{what}"], saved[f"megatron/{step}/{what}"]
                    assert ours.shape == theirs.shape and np.array_equal(ours, theirs), (rank, mode, step, what)
            idle = saved[f"{mode}/1/dweights"]
            assert (idle == 0).all() if rank == 1 else idle.any(axis=(1, 2)).all(), (rank, mode)
        assert saved["groupgemm dropless/1/rows"].shape[0] == (0 if rank == 1 else 24)


@pytest.mark.parametrize("experts", ["SequentialMLP", "TEGroupedMLP"])
def test_experts_that_split_rows_by_tokens_per_expert_take_capacity_modes_padding(two_rank_results, experts):
    # Capacity mode's padding rows are counted into the last local expert's tokens, so
    # experts that split their rows by tokens_per_expert (SequentialMLP; TEGroupedMLP adding
    # its bias) run, on rank 1 at step 1 on padding alone, and give dropless mode's values;
    # the padding adds exact zeros to the last expert's gradients.
    for rank, saved in enumerate(two_rank_results):
        names = [key.split("/")[-1] for key in saved if key.startswith(f"{experts}/dropless/0/")]
        assert len(names) == 3 + 4 * LOCAL_EXPERTS if experts == "SequentialMLP" else 7, names
        for step in range(2):
            for what in names:
                dropless = saved[f"{experts}/dropless/{step}/{what}"]
                np.testing.assert_allclose(saved[f"{experts}/capacity/{step}/{what}"], dropless, rtol=1e-6, atol=1e-6,
                                           err_msg=f"{rank} {step} {what}")
        for what in names[3:]:  # every parameter's gradient: exact zeros on the idle rank only
            for mode in ("dropless", "capacity"):
                grad = saved[f"{experts}/{mode}/1/{what}"]
                assert (grad == 0).all() if rank == 1 else grad.any(), (rank, mode, what)


def test_use_groupgemm_dispatcher_puts_it_into_a_moe_layer_with_the_same_bits(process_groups, monkeypatch):
    # One rank: Megatron's all-gather dispatcher only permutes, and so does groupgemm's.
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # Megatron's router moves its weight there
    config = _config(moe_router_topk=2, moe_token_dispatcher_type="allgather")
    spec = MoESubmodules(experts=ModuleSpec(module=TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear)))
    torch.manual_seed(0)
    theirs, ours = MoELayer(config, spec, pg_collection=process_groups), MoELayer(config, spec,
                                                                                   pg_collection=process_groups)
    ours.load_state_dict(theirs.state_dict())
    assert use_groupgemm_dispatcher(ours) is ours and type(ours.token_dispatcher) is token_dispatcher_class()
    x = torch.randn(5, 2, HIDDEN, dtype=torch.bfloat16)
    results = []
    for layer in (theirs, ours):
        x_grad = x.clone().requires_grad_()
        y, _ = layer(x_grad)
        y.float().square().sum().backward()
        results.append((y, x_grad.grad, [p.grad for p in layer.parameters()]))
    (y1, dx1, grads1), (y2, dx2, grads2) = results
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    assert all(torch.equal(g1, g2) for g1, g2 in zip(grads1, grads2))


def test_use_groupgemm_dispatcher_stays_in_a_layer_built_for_inference_optimized_runs(process_groups, monkeypatch):
    # Such a layer keeps its training dispatcher aside and puts it back at every training
    # forward: the replacement was undone by the first one, silently.
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, ffn_hidden_size=FFN,
                               moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=2,
                               gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                               add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True,
                               moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                               transformer_impl="inference_optimized", moe_router_dtype="fp32",
                               normalization="RMSNorm")
    spec = MoESubmodules(experts=ModuleSpec(module=TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear)))
    layer = use_groupgemm_dispatcher(MoELayer(config, spec, pg_collection=process_groups), capacity=4)
    layer(torch.randn(3, 1, HIDDEN))
    assert type(layer.token_dispatcher) is token_dispatcher_class()


def test_token_dispatcher_refuses_what_it_does_not_implement(process_groups):
    dispatcher_cls = token_dispatcher_class()
    config = _config()
    config.moe_permute_fusion = True  # TransformerConfig itself refuses it without TransformerEngine
    with pytest.raises(NotImplementedError, match="moe_permute_fusion"):
        dispatcher_cls(EXPERTS, list(range(EXPERTS)), config, process_groups)
    with pytest.raises(ValueError, match="local_expert_indices"):
        dispatcher_cls(2, [1, 2], _config(), process_groups)


def test_the_dispatcher_class_pickles_by_name_and_resolves_to_itself():
    # Made at run time: pickle finds it through the integration module's __getattr__, which
    # a fresh process answers by making it (a whole model saved with torch.save).
    assert pickle.loads(pickle.dumps(token_dispatcher_class())) is token_dispatcher_class()
