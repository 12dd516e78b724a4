"""Compiler passes: linears that read one input fused into one matmul (projections)."""
