"""Fused compute kernels (MLAProlog, attention, gating, grouped GEMM, quant ops) with torch references.

Built in later issues; see DESIGN.md section 5.
"""
