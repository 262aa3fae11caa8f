"""groupgemm in ``jax.export`` artifacts.

``jax.export.export`` refuses custom calls whose targets have no compatibility guarantee,
as groupgemm's XLA FFI targets have none: their operands and attributes are those of the
groupgemm release that traced them. Exporting therefore names them in ``disabled_checks``,
and the artifact runs only where the same groupgemm is imported (which registers them).
"""

from groupgemm import _core


def export_disabled_checks() -> list:
    """``jax.export.DisabledSafetyCheck.custom_call`` for each of groupgemm's XLA FFI targets.

    Pass it as ``jax.export.export(fn, disabled_checks=export_disabled_checks())``. The
    exported function then runs where ``groupgemm.jax`` of the same version is imported
    (importing it registers the targets, for the CPU and, when compiled, for CUDA);
    elsewhere XLA fails to find the custom call targets.
    """
    # Imported here: jax.export needs absl-py, which jax itself does not require.
    from jax import export

    names = sorted(_core.ffi_handlers()["cpu"])  # {platform: {target: capsule}}, the same targets on each
    return [export.DisabledSafetyCheck.custom_call(name) for name in names]
