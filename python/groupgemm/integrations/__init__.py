"""Adapters that plug groupgemm into training frameworks' own MoE layers.

``groupgemm.integrations.torchtitan`` overrides torchtitan's grouped-GEMM seam;
``groupgemm.integrations.megatron`` holds the ``linear_fc1`` / ``linear_fc2`` builders a
Megatron-core layer spec names for ``TEGroupedMLP``; ``groupgemm.integrations.transformers``
is Hugging Face transformers' ``experts_implementation="groupgemm"``. They live beside
``groupgemm.torch`` rather than inside it: ``groupgemm.torch`` is the framework's face, these
are one client each. Each imports without its client installed (torchtitan's and Megatron's
work on the client's objects they are handed; transformers' registers itself only when
transformers is there), so the API reference builds without any of them.
"""
