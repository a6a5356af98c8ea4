"""Expert-placement load balancing: load collection, redundant experts, placement, replica rotation.

Stands alone on numpy/torch. Built in a later issue; see DESIGN.md section 7.
"""
