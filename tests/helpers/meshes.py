"""The suite's meshes, made of the CPU devices (conftest.py gives JAX four), also on a
machine whose default backend is a GPU with fewer devices."""

import math

import jax


def cpu_mesh(shape, names, axis_type=jax.sharding.AxisType.Auto):
    devices = jax.devices("cpu")[:math.prod(shape)]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=devices)
