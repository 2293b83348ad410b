"""Adapters that route frameworks' own checkpoint calls through the tiered DCP writer and reader.

One subpackage per framework (``deepspeed``, ``hf``, ``megatron``; ``torchtitan`` and
``torchtitan_ft`` are single modules), each importing its framework lazily: importing
``dcp_tiered`` never needs DeepSpeed, Megatron or transformers. The adapters build on the
public API and :mod:`dcp_tiered.lifecycle` only (tests/test_layering.py), and share
:mod:`dcp_tiered.shims._common`. ``deepspeed_convert``, ``hf_deepspeed``,
``megatron_strategy``, ``megatron_load`` and ``megatron_convert`` are the former import paths
of modules now inside the subpackages, kept.
"""
