"""Hybrid MoE layer: expert placement, precision and execution."""
