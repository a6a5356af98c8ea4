"""`ascend-emu model` ops of the kernels layer: importing this module registers them (the CLI does on start)."""
import importlib
import importlib.util

# one registration module per kernel family; each registers its ops when imported
FAMILIES = ("kernels.gemm_ops", "kernels.mla_ops", "kernels.moe_ops")

for _mod in FAMILIES:
    if importlib.util.find_spec(_mod) is not None:   # a family lands in its own change; absent until then
        importlib.import_module(_mod)
