"""Worker of test_megatron.py's expert-parallel test: Megatron-core's own all-to-all token
dispatcher and groupgemm's (groupgemm.integrations.megatron.token_dispatcher_class),
dropless and with a capacity, on the same tokens, routing and experts over 2 gloo ranks
(expert-parallel size 2; at step 1 no token goes to rank 1's experts). Each rank saves, per
dispatcher and step, the rows and probs its experts got, the combined output and the
gradients of its tokens, probs and experts' weights.

Usage: python megatron_ep_worker.py OUT_DIR
"""

import contextlib
import os
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import groupgemm.torch as gt


class _HostStream:
    """Megatron's all-to-all dispatcher copies its counts to the host on a side CUDA stream
    (one it creates, waits on and records events on) and gathers them into a buffer on the
    current CUDA device, then hands the split sizes to all_to_all_single as numpy arrays; on
    the CPU the copy is already synchronous, so the stream calls do nothing here, the
    current device is the CPU and the host copy is only the numpy conversion."""

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


def _run_megatron_stream_calls_on_the_host():
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = (
        lambda t, as_numpy=False, record_stream=False: t.numpy() if as_numpy and torch.is_tensor(t) else t)
    stream = _HostStream()
    torch.cuda.Stream = lambda *args, **kwargs: stream
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"

WORLD, LOCAL_EXPERTS, TOKENS, DIM, TOP_K = 2, 2, 6, 8, 2
EXPERTS = WORLD * LOCAL_EXPERTS


def step_inputs(step, rank):
    """Tokens, a [T, E] routing mask with k experts per token (none of rank 1's at step 1),
    [T, E] probs, and this rank's expert weights."""
    gen = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(TOKENS, DIM, generator=gen)
    high = LOCAL_EXPERTS if step == 1 else EXPERTS
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool)
    for t in range(TOKENS):
        routing_map[t, torch.randperm(high, generator=gen)[:TOP_K]] = True
    probs = torch.rand(TOKENS, EXPERTS, generator=gen) * routing_map
    weights = torch.randn(EXPERTS, DIM, DIM, generator=torch.Generator().manual_seed(99))
    return x, routing_map, probs, weights[rank * LOCAL_EXPERTS:(rank + 1) * LOCAL_EXPERTS]


def experts_behind_groupgemms_dispatcher(rank, groups, dispatcher_class):
    """Megatron's experts that split their rows by tokens_per_expert (SequentialMLP, and
    TEGroupedMLP on groupgemm's builders adding its bias) through a MoELayer's six steps on
    groupgemm's dispatcher, dropless and with a capacity, the same weights for both: the
    output and the gradients of the tokens, probs and every expert parameter."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from groupgemm.integrations.megatron import ColumnParallelGroupedLinear, RowParallelGroupedLinear

    config = TransformerConfig(num_layers=1, hidden_size=DIM, ffn_hidden_size=DIM, moe_ffn_hidden_size=DIM,
                               num_attention_heads=1, num_moe_experts=EXPERTS, moe_router_topk=TOP_K,
                               expert_model_parallel_size=WORLD, add_bias_linear=True, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
                               use_cpu_initialization=True)
    builders = {"SequentialMLP": lambda: SequentialMLP(LOCAL_EXPERTS, config, MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), pg_collection=groups),
                "TEGroupedMLP": lambda: TEGroupedMLP(LOCAL_EXPERTS, config, GroupedMLPSubmodules(
                    linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear),
                    pg_collection=groups)}
    local = list(range(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS))
    saved = {}
    for kind, build in builders.items():
        torch.manual_seed(rank)
        experts = build()
        with torch.no_grad():  # biases start at zero; nonzero ones reach the padding rows
            for p in experts.parameters():
                p.uniform_(-0.5, 0.5)
        for mode, capacity in (("dropless", None), ("capacity", TOKENS * TOP_K)):
            dispatcher = dispatcher_class(LOCAL_EXPERTS, local, config, groups, capacity=capacity)
            for step in range(2):
                x, routing_map, probs, _ = step_inputs(step, rank)
                x.requires_grad_(), probs.requires_grad_()
                experts.zero_grad(set_to_none=True)
                hidden, slot_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
                rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(
                    *dispatcher.token_dispatch(hidden, slot_probs))
                expert_out, bias = experts(rows, tokens_per_expert, row_probs)
                assert bias is None
                out = dispatcher.combine_postprocess(dispatcher.token_combine(expert_out))
                out.backward(torch.ones_like(out))
                results = {"out": out, "dx": x.grad, "dprobs": probs.grad}
                results.update((f"d.{n}", torch.zeros_like(p) if p.grad is None else p.grad)
                               for n, p in experts.named_parameters())
                for what, t in results.items():
                    saved[f"{kind}/{mode}/{step}/{what}"] = t.detach().numpy()
    return saved


def run(rank, out_dir):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from groupgemm.integrations.megatron import token_dispatcher_class

    _run_megatron_stream_calls_on_the_host()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=WORLD)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=WORLD)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    config = TransformerConfig(num_layers=1, hidden_size=DIM, num_attention_heads=1, num_moe_experts=EXPERTS,
                               moe_router_topk=TOP_K, expert_model_parallel_size=WORLD, add_bias_linear=False,
                               use_cpu_initialization=True, moe_token_dispatcher_type="alltoall")
    local = list(range(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS))
    ours = token_dispatcher_class()
    dispatchers = {"megatron": MoEAlltoAllTokenDispatcher(LOCAL_EXPERTS, local, config=config, pg_collection=groups),
                   "groupgemm dropless": ours(LOCAL_EXPERTS, local, config, groups),
                   "groupgemm capacity": ours(LOCAL_EXPERTS, local, config, groups, capacity=TOKENS * TOP_K)}
    saved = {}
    for name, dispatcher in dispatchers.items():
        for step in range(2):
            x, routing_map, probs, weights = step_inputs(step, rank)
            x.requires_grad_(), probs.requires_grad_(), weights.requires_grad_()
            # MoELayer's sequence of the six steps, with experts that weight their rows.
            hidden, slot_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
            hidden, slot_probs = dispatcher.token_dispatch(hidden, slot_probs)
            rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(hidden, slot_probs)
            # Capacity mode's padding rows come last, counted into the last expert's tokens
            # for experts that split the rows by them. These experts multiply the rows each
            # expert received (the rest are padding, exact zeros): counting the padding in
            # would change the last expert's GEMM rows, which a library GEMM may round by
            # (oneDNN on AVX-512 rounds a dgrad row otherwise among fewer than 16 rows than among more).
            received = tokens_per_expert if name == "megatron" else dispatcher.tokens_per_expert
            sizes = torch.as_tensor(received).to(torch.int32)
            expert_out = gt.grouped_mm(rows, weights, sizes) * row_probs[:, None]
            out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(expert_out)))
            out.backward(torch.ones_like(out))
            valid = int(sizes.sum())
            assert int(torch.as_tensor(tokens_per_expert).sum()) == rows.shape[0]
            assert not rows[valid:].any() and not row_probs[valid:].any()
            for what, t in (("rows", rows[:valid]), ("row_probs", row_probs[:valid]), ("out", out),
                            ("dx", x.grad), ("dprobs", probs.grad), ("dweights", weights.grad)):
                saved[f"{name}/{step}/{what}"] = t.detach().numpy()
    saved.update(experts_behind_groupgemms_dispatcher(rank, groups, ours))
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **saved)
    dist.barrier()  # no rank tears the group down while a peer is still in its last exchange
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=WORLD, join=True)
