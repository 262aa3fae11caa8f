import os
import sys

# Several CPU devices for the shard_map tests; must be set before JAX initialises. First, so
# that flags the environment already sets (with another device count among them) still apply.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 " + os.environ.get("XLA_FLAGS", "")
# The shared case table, the reference, the frontend adapters and the workers.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
# The examples' MoE dispatch helper, shared by the demo, the tests and the workers.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
# The GPU kit's modules: its own tests, and the CUDA-graph capture helper test_cuda.py shares;
# the benchmarks' (the Hopper kernel table among them).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

# On a machine with a GPU, JAX's default device is the GPU: keep the tests written for the
# CPU backend on the CPU, as torch's are by default. The CUDA tests name their device.
try:
    import jax
except ImportError:  # the torch-only install check
    pass
else:
    jax.config.update("jax_default_device", "cpu")
