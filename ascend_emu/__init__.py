"""ascend-emu: write, run, check and time Ascend-NPU-style kernels and far-memory protocols on a CPU.

    from ascend_emu import Pod, kernel, cloudmatrix384
    pod = Pod(cloudmatrix384(dies=2))
    run = pod.launch(my_kernel, die=0, aiv=48, args=(x_gm, y_gm))
    run.modeled_us, run.pipe_busy, run.trace.save("t.json"), run.plot("t.png")
"""
from ._build import select as _select

ENGINE_BUILD = _select(__name__)   # "compiled" (Cython build of the hot modules) or "python" (their sources)

from . import dtypes  # noqa: E402  (after the build is chosen: these import the hot modules)
from .dtypes import bf16, fp16, fp32, int8, int32
from .errors import (AddressError, AlignmentError, ArgumentError, CapacityError, DeadlockError, DTypeError,
                     EmulatorError, FaultError, HazardError, KernelError, NotPartitionableError, NumericError,
                     RaceError, ShapeError, WorkerError)
from .explore import ExploreReport, explore
from .races import Race
from .kernel import Kernel, KernelContext, kernel
from .layout import nd_to_nz, nz_to_nd, nz_shape
from .memory import GMTensor
from .buffers import LocalTensor
from .pod import Launch, Pod, RunResult, Stream
from .profile import HardwareProfile, cloudmatrix384
from .spmd import spmd  # noqa: E402  (the function; the module stays importable as ascend_emu.spmd's sys.modules entry)

__version__ = "0.1.0"

__all__ = [
    "ENGINE_BUILD", "spmd", "Pod", "Stream", "Launch", "RunResult", "kernel", "Kernel", "KernelContext",
    "HardwareProfile",
    "cloudmatrix384", "GMTensor", "LocalTensor", "nd_to_nz", "nz_to_nd", "nz_shape", "dtypes",
    "fp32", "fp16", "bf16", "int8", "int32",
    "EmulatorError", "ArgumentError", "CapacityError", "AlignmentError", "AddressError", "DTypeError", "ShapeError",
    "DeadlockError", "HazardError", "FaultError", "KernelError", "NumericError", "RaceError", "NotPartitionableError",
    "WorkerError", "Race", "explore",
    "ExploreReport",
]
