"""groupgemm inside torchtitan's MoE layers (torchtitan 0.3).

torchtitan's ``GroupedExperts.forward`` (``torchtitan.models.common.moe``, and
``GptOssGroupedExperts``) calls an overridable seam for each of its grouped GEMMs::

    self._grouped_mm(A=x_RD.bfloat16(), B_t=w1_EFD.bfloat16().transpose(-2, -1), offs=offsets_E)

with ``offs`` the int32 cumulative token counts and ``B_t`` a transposed view of the
``[E, F, D]`` weight. torchtitan's own MXFP8 converter overrides that seam in a subclass;
:func:`use_groupgemm` does the same with :func:`grouped_mm`. Rows past ``offs[-1]`` then
come out as exact zeros (``torch._grouped_mm`` leaves them uninitialised), and so do their
input gradients.

Replacing ``torch._grouped_mm`` itself by ``groupgemm.torch.grouped_mm(A, B, offs=offs)``
would work too, but would copy each expert weight on every call: ``B_t`` is a transposed
view, which groupgemm reads in place only when told it is the transposed layout.

Its MoE layers' token exchange between expert-parallel ranks is a token dispatcher
(``torchtitan.models.common.token_dispatcher``: ``dispatch(x, scores, expert_ids, counts)``
and ``combine(expert_out, metadata, x)``). :func:`token_dispatcher_class` is one on
groupgemm's dispatch and combine (capacity or dropless), and :func:`use_groupgemm_dispatch`
switches a model config's dispatchers to it.
"""

import functools
import importlib
import sys
from dataclasses import dataclass, fields

import torch

from groupgemm.torch_ext.functional import grouped_mm as _grouped_mm

__all__ = ["experts_class", "grouped_mm", "token_dispatcher_class", "use_groupgemm", "use_groupgemm_dispatch"]

_EXPERTS_CLASSES: dict[type, type] = {}
_EXPERTS_PREFIX = "GroupGemm"  # experts_class's name for the subclass of a parent class


def grouped_mm(*, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``GroupedExperts._grouped_mm(A=..., B_t=..., offs=...)`` on groupgemm.

    ``A [M, K]`` rows sorted by expert, ``B_t [E, K, N]`` (any strides; a transposed view of
    an ``[E, N, K]`` weight, as torchtitan passes it, is read in place), ``offs [E]`` int32
    cumulative group ends on A's device. Returns ``[M, N]`` in A's dtype; rows past
    ``offs[-1]`` are exact zeros. Differentiable in ``A`` and ``B_t``; an expert without
    tokens gets an exact-zero weight gradient. Errors are ``groupgemm.torch.grouped_mm``'s
    (``TypeError`` / ``ValueError`` naming the argument).
    """
    if not B_t.is_contiguous() and B_t.dim() == 3 and B_t.transpose(-2, -1).is_contiguous():
        return _grouped_mm(A, B_t.transpose(-2, -1), offs=offs, transpose_weight=True)
    return _grouped_mm(A, B_t, offs=offs)


def experts_class(experts_cls: type) -> type:
    """The subclass of a torchtitan experts class whose ``_grouped_mm`` is :func:`grouped_mm`.

    ``experts_cls`` is ``torchtitan.models.common.moe.GroupedExperts`` or any subclass that
    calls the ``_grouped_mm`` seam (``GptOssGroupedExperts``). The subclass keeps the
    parent's ``Config`` fields; one class per parent is made and reused.
    """
    if not (isinstance(experts_cls, type) and callable(getattr(experts_cls, "_grouped_mm", None))):
        raise TypeError(f"experts_class: experts_cls must be a torchtitan experts class with a _grouped_mm seam, "
                        f"got {experts_cls!r}")
    cached = _EXPERTS_CLASSES.get(experts_cls)
    if cached is not None:
        return cached
    @dataclass(kw_only=True, slots=True)
    class Config(experts_cls.Config):
        pass

    def _seam(self, *, A, B_t, offs):
        return grouped_mm(A=A, B_t=B_t, offs=offs)

    # torchtitan's Configurable.__init_subclass__ wires Config._owner to the new class.
    name = f"{_EXPERTS_PREFIX}{experts_cls.__name__}"
    Config.__qualname__ = f"{name}.Config"
    cls = type(name, (experts_cls,), {"Config": Config, "_grouped_mm": _seam, "__module__": __name__})
    _EXPERTS_CLASSES[experts_cls] = cls
    return cls


def use_groupgemm(model_config, experts_config_cls=None):
    """Switches every grouped-experts config in a torchtitan model config to groupgemm.

    Call it on ``ModelSpec.model`` (or any ``Configurable.Config``) before the model is
    built, as torchtitan's own converters do. ``experts_config_cls`` is the config class
    to look for, ``torchtitan.models.common.moe.GroupedExperts.Config`` by default (its
    subclasses, such as ``GptOssGroupedExperts.Config``, match too). Returns the config,
    which is a new object when the root itself was an experts config.
    """
    if experts_config_cls is None:
        from torchtitan.models.common.moe import GroupedExperts

        experts_config_cls = GroupedExperts.Config

    def switched(config):
        owner = type(config)._owner
        if owner in _EXPERTS_CLASSES.values():
            return None  # already switched
        return experts_class(owner).Config(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})

    return _replace_configs(model_config, experts_config_cls, switched)


def _replace_configs(model_config, config_cls, replacement):
    """Each config of ``config_cls`` in the tree under ``model_config`` replaced, in place, by
    ``replacement(config)`` (None: kept). Returns the root, a new object when it was one."""
    for _, config, parent, attr in list(model_config.traverse(config_cls)):
        new_config = replacement(config)
        if new_config is None:
            continue
        if parent is None:
            model_config = new_config
        elif isinstance(parent, list):
            parent[attr] = new_config
        else:
            setattr(parent, attr, new_config)
    return model_config


# Options of torchtitan's dispatchers that change which tokens reach the experts: switching
# one silently would change the model. Their other options (buffer sizes, padding each
# expert's rows, CUDA-graph modes) say how theirs run, not what it computes.
_DROPPING_OPTIONS = ("non_blocking_capacity_factor",)


@functools.cache  # one class, made on first use
def token_dispatcher_class() -> type:
    """torchtitan's expert-parallel token dispatcher on groupgemm.torch's dispatch and combine.

    A ``BaseEPTokenDispatcher`` whose ``Config`` adds ``capacity`` (None: dropless, one host
    copy of the counts per step, as torchtitan's all-to-all dispatcher makes; an int: every
    pair of ranks exchanges that many rows, static shapes, no host copy). ``dispatch``
    returns the rows grouped by local expert with their counts, as torchtitan's experts
    take them (in capacity mode, zero padding rows after them, which the experts' grouped
    GEMMs leave alone); ``combine`` sums ``scores * expert_out`` per token in float32 in slot
    order. Zero tokens on a rank, or for its experts, are ordinary input. Without an EP mesh
    (EP = 1) the rows are only permuted, with the same core ops.
    """
    from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher

    import groupgemm.torch as gt

    class GroupgemmTokenDispatcher(BaseEPTokenDispatcher):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseEPTokenDispatcher.Config):
            capacity: int | None = None

        def __init__(self, config):
            super().__init__(config)
            self.capacity = config.capacity

        def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
            del num_local_tokens_per_expert_E  # recounted on the device by permute
            if self.ep_mesh is None:
                rows, sizes, row_map = gt.permute(x_TD, topk_expert_ids_TK, self.num_experts)
                return rows, sizes, (row_map, topk_scores_TK)
            rows, sizes, plan = gt.dispatch(x_TD, topk_expert_ids_TK, self.num_experts, self.ep_mesh.get_group(),
                                            capacity=self.capacity)
            return rows, sizes, (plan, topk_scores_TK)

        def combine(self, routed_output_RD, metadata, x_TD):
            plan, scores = metadata
            if self.ep_mesh is None:
                out = gt.unpermute(routed_output_RD, plan, scores)
            else:
                out = gt.combine(routed_output_RD, plan, scores)
            return out.to(x_TD.dtype)  # x's dtype, as torchtitan's dispatchers return it (experts may run in another)

    GroupgemmTokenDispatcher.__module__ = __name__
    GroupgemmTokenDispatcher.__qualname__ = "GroupgemmTokenDispatcher"  # as __getattr__ finds it
    GroupgemmTokenDispatcher.Config.__qualname__ = "GroupgemmTokenDispatcher.Config"
    return GroupgemmTokenDispatcher


def __getattr__(name):
    """The classes made at run time, by the names pickle looks them up under (a whole model
    or config pickled, or saved with torch.save): the dispatcher, and each experts subclass,
    made from the torchtitan class of its parent's name. That class's module is imported by
    then, as a model's unpickling imports its own classes' modules first; GroupedExperts'
    module is imported here."""
    if name == "GroupgemmTokenDispatcher":
        return token_dispatcher_class()
    if name.startswith(_EXPERTS_PREFIX):
        importlib.import_module("torchtitan.models.common.moe")
        parent_name = name[len(_EXPERTS_PREFIX):]
        for module_name, loaded in list(sys.modules.items()):
            parent = getattr(loaded, parent_name, None) if module_name.startswith("torchtitan.") else None
            if isinstance(parent, type) and callable(getattr(parent, "_grouped_mm", None)):
                return experts_class(parent)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_groupgemm_dispatch(model_config, capacity=None):
    """Switches every token-dispatcher config in a torchtitan model config to
    :func:`token_dispatcher_class`'s (keeping ``num_experts`` and ``top_k``), with
    ``capacity`` (None: dropless). Call it on ``ModelSpec.model`` before the model is built.
    Returns the config (a new object when the root itself was a dispatcher config)."""
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    new_cls = token_dispatcher_class().Config

    def switched(config):
        if isinstance(config, new_cls):
            return None
        for option in _DROPPING_OPTIONS:
            if getattr(config, option, None) is not None:
                raise NotImplementedError(
                    f"use_groupgemm_dispatch: {type(config).__qualname__}.{option} = {getattr(config, option)!r} "
                    "drops tokens by a rule groupgemm's dispatch does not have; unset it, and pass capacity= (the "
                    "rows each pair of ranks exchanges) to drop tokens")
        return new_cls(num_experts=config.num_experts, top_k=config.top_k, capacity=capacity)

    return _replace_configs(model_config, LocalTokenDispatcher.Config, switched)
