"""Offline INT8 post-training quantisation (SmoothQuant, GPTQ, scale search, clipping, KV-cache INT8).

Stands alone on numpy/torch. Built in a later issue; see DESIGN.md section 6.
"""
