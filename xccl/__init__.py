"""XCCL: far-memory communication protocols (send/recv, dispatch/combine, A2E/E2A) as kernels on ascend_emu.

Built in later issues; see DESIGN.md section 4.
"""
