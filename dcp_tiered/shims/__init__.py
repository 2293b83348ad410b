"""Adapters that route frameworks' own checkpoint calls through the tiered DCP writer and reader.

Each submodule imports its framework lazily: importing ``dcp_tiered`` never needs DeepSpeed,
Megatron or transformers.
"""
