import os
import sys

# Several CPU devices for the shard_map tests; must be set before JAX initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(__file__))
