"""Adapters that plug groupgemm into training frameworks' own MoE layers.

``groupgemm.integrations.torchtitan`` overrides torchtitan's grouped-GEMM seam;
``groupgemm.integrations.megatron`` holds the ``linear_fc1`` / ``linear_fc2`` builders a
Megatron-core layer spec names for ``TEGroupedMLP``. They live beside ``groupgemm.torch``
rather than inside it: ``groupgemm.torch`` is the framework's face, these are one client
each. Neither imports its client when imported (they work on the client's objects they are
handed), so the API reference builds without torchtitan or Megatron-core installed.
"""
