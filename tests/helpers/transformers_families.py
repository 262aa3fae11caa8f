"""The installed transformers' experts classes that take an experts implementation, found
from the release itself (a family added upstream is covered on upgrade), and each one
built tiny from its own config class."""

import functools
import importlib
import inspect
import os

import torch

# The experts' sizes, by the config attributes the families read them from.
EXPERTS, HIDDEN, FFN = 4, 8, 6
SIZES = {"num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS,
         "moe_num_experts": EXPERTS, "hidden_size": HIDDEN, "moe_hidden_size": HIDDEN, "intermediate_size": FFN,
         "moe_intermediate_size": FFN}
MAX_PARAMETERS = 10_000  # a tiny build: more means a size attribute SIZES does not know


def _dispatching_forward_code():
    """The code object of the forward that ``use_experts_implementation`` installs: every
    decorated class's forward is a function with this code (the marker)."""
    from transformers.integrations.moe import use_experts_implementation

    class Probe(torch.nn.Module):
        def forward(self):
            pass

    return use_experts_implementation(Probe).forward.__code__


@functools.cache
def decorated_classes():
    """[(family, class)] of every decorated experts class, sorted. Families are the model
    folders whose modeling module names the decorator (transformers' own test of whether a
    model can set its experts implementation reads the module source the same way); a
    class is decorated when its forward is the decorator's dispatching one."""
    import transformers

    marker = _dispatching_forward_code()
    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = []
    for family in sorted(os.listdir(models)):
        path = os.path.join(models, family, f"modeling_{family}.py")
        if not os.path.exists(path) or "use_experts_implementation" not in open(path, encoding="utf-8").read():
            continue
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        found += [(family, cls) for cls in vars(module).values()
                  if isinstance(cls, type) and cls.__module__ == module.__name__
                  and getattr(getattr(cls, "forward", None), "__code__", None) is marker]
    return found


def tiny_config(cls):
    """A default config of the family's own config classes, with SIZES set, from which
    ``cls`` builds with at most MAX_PARAMETERS parameters (tried on the meta device)."""
    from transformers import PreTrainedConfig

    module = importlib.import_module(cls.__module__)
    candidates = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, PreTrainedConfig)]
    failures = []
    for config_cls in candidates:
        try:
            config = config_cls()
            for name, value in SIZES.items():
                if hasattr(config, name):  # a list holds one width per kind of expert
                    old = getattr(config, name)
                    setattr(config, name, [value] * len(old) if isinstance(old, list) else value)
            with torch.device("meta"):
                built = build(cls, config)
        except Exception as error:  # a sibling config (vision, audio) that is not this one's
            failures.append(f"{config_cls.__name__}: {type(error).__name__}: {error}")
            continue
        count = sum(p.numel() for p in built.parameters())
        if count <= MAX_PARAMETERS:
            return config
        failures.append(f"{config_cls.__name__}: {count} parameters; a size attribute is missing from SIZES")
    raise AssertionError(f"{cls.__name__}: no tiny config: " + "; ".join(failures))


def build(cls, config):
    """``cls(config)``, with the width its MoE block would pass where it takes one
    (``intermediate_size``: families with several kinds of experts)."""
    takes_width = "intermediate_size" in inspect.signature(cls.__init__).parameters
    return cls(config, intermediate_size=FFN) if takes_width else cls(config)


def tiny_experts(cls, dtype, seed=0):
    """``cls`` built from its tiny config in ``dtype``, every parameter and floating buffer
    drawn from N(0, 0.5^2) (the classes allocate them with torch.empty)."""
    module = build(cls, tiny_config(cls)).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float64) * 0.5)
    return module


def eager_forward(module, *args):
    """The class's own forward (the one the decorator wraps), whatever the config selects."""
    return type(module).forward.__wrapped__(module, *args)
