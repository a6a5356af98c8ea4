"""A thin serving loop: a mini DeepSeek-style MoE model over an emulated pod.

Built in a later issue; see DESIGN.md section 8.
"""
