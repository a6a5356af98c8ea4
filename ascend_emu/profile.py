"""Hardware profile: every timing and capacity constant of the emulated machine, and nothing else.

A profile is a frozen value: copy and change it with ``dataclasses.replace(cloudmatrix384(), hbm_gbps=1200)``.
Only the instruction/timing layer reads it. Figures and their sources are in DESIGN.md 3.1; the latency constants are
not published directly and are calibration parameters (see ``CALIBRATION`` below for where each value comes from).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Where each latency default comes from. "estimate" values are placeholders that a calibration fit replaces;
# the fit and its data are documented next to the fitted profile.
CALIBRATION = {
    "gm_latency_ns": "estimate: HBM load-to-use on Ascend-class dies is several hundred ns",
    "fabric_latency_ns": "estimate: one Unified-Bus hop inside a server; CloudMatrix384 paper gives inter-node < 1 us extra",
    "inter_node_latency_ns": "paper: inter-node adds < 1 us; 0.6 us chosen inside that bound",
    "dma_startup_ns": "estimate: DMA descriptors and doorbell cost several us, far above the mtu path",
    "launch_single_op_us": "estimate: host-side dispatch of one kernel in single-op mode",
    "comm_start_us": "fit (kernels.calibrate.fit): least squares over the 12 points of DESIGN.md 9 (CANN EP dispatch "
                     "and combine, EP 8..256, 128 tokens, hidden 7168, top-8) with poll_field_ns; 47.6 us; covers "
                     "the device-side setup of a communication operator that the model does not detail",
    "poll_field_ns": "fit (same fit): 133 ns per extra 32-byte field read by a poll loop; plausible for a scalar GM "
                     "read; dispatch polls 256 status records, combine polls one counter per token. With both "
                     "constants the model is within 4.7 % mean / 10.4 % worst of the table (ascend-emu calibrate)",
    "launch_graph_us": "estimate: per-kernel cost when the kernel runs inside a captured graph",
}


@dataclass(frozen=True)
class HardwareProfile:
    """One die of an Ascend 910-class chip plus the pod around it. Units are in the field names."""

    name: str = "cloudmatrix384-die"
    # --- pod topology: CloudMatrix384 = 48 servers x 8 chips x 2 dies
    dies: int = 768
    dies_per_chip: int = 2
    chips_per_server: int = 8
    # --- cores per die; each AIC pairs with 2 AIV (MIX mode)
    aic_per_die: int = 24
    aiv_per_die: int = 48
    aiv_per_aic: int = 2
    clock_ghz: float = 1.8
    # --- core-local buffers: capacity (bytes) and alignment (bytes)
    ub_bytes: int = 192 * KiB
    ub_align: int = 32
    l1_bytes: int = 512 * KiB
    l1_align: int = 32
    l0a_bytes: int = 64 * KiB
    l0b_bytes: int = 64 * KiB
    l0ab_align: int = 512
    l0c_bytes: int = 128 * KiB
    l0c_align: int = 64
    bt_bytes: int = 1 * KiB
    bt_align: int = 64
    fb_bytes: int = 7 * KiB
    fb_align: int = 64
    # --- cube: one fractal MAC block per cycle; fp16/bf16 16x16x16 (fp32 acc), int8 16x32x16 (int32 acc)
    cube_m: int = 16
    cube_n: int = 16
    cube_k_fp16: int = 16
    cube_k_int8: int = 32
    cube_k_fp32: int = 8
    cube_startup_cycles: int = 24
    # --- vector: 256 bytes per repeat, at most 255 repeats per instruction
    vec_bytes_per_repeat: int = 256
    vec_max_repeat: int = 255
    vec_startup_cycles: int = 16
    # --- scalar unit
    issue_cycles: int = 4            # scalar cost to issue one pipe instruction (parameter setup + dispatch)
    scalar_op_cycles: int = 1
    # --- per-core data movers (bytes per cycle) and their fixed start-up
    mte2_bytes_per_cycle: int = 64   # GM -> UB / L1 (mtu-in)
    mte3_bytes_per_cycle: int = 64   # UB -> GM (mtu-out)
    mte1_bytes_per_cycle: int = 256  # L1 -> L0A / L0B
    fixp_bytes_per_cycle: int = 128  # L0C -> GM / L1
    mte_startup_cycles: int = 32
    burst_bytes: int = 32            # copies move whole 32-byte bursts per block
    # --- shared memory system (GB/s = 1e9 bytes/s)
    hbm_bytes: int = 64 * GiB
    hbm_gbps: float = 1600.0
    fabric_gbps: float = 196.0       # Unified-Bus, per direction per die
    inter_node_bw_loss: float = 0.03
    d2d_gbps: float = 224.0          # the two dies of one chip
    dma_engines_per_die: int = 1
    dma_gbps: float = 196.0
    # --- latencies (calibration parameters, see CALIBRATION)
    gm_latency_ns: float = 400.0
    fabric_latency_ns: float = 1200.0
    d2d_latency_ns: float = 600.0
    inter_node_latency_ns: float = 600.0
    dma_startup_ns: float = 4000.0
    flag_latency_ns: float = 60.0    # AIC <-> AIV cross-core flag
    barrier_ns: float = 800.0        # SyncAll among the cores of one die
    poll_field_ns: float = 133.0     # scalar cost per extra 32-byte field read by one poll loop (fit)
    comm_start_us: float = 47.6      # device-side start of a communication kernel (fit)
    launch_single_op_us: float = 15.0
    launch_graph_us: float = 2.0
    cross_core_flag_max: int = 15    # a 4-bit counter: the 16th set without a wait hangs real hardware

    # ---------------------------------------------------------------- derived helpers (not constants)
    @property
    def cycle_ps(self) -> float:
        return 1000.0 / self.clock_ghz

    def cycles_to_ps(self, cycles: float) -> int:
        return int(round(cycles * 1000.0 / self.clock_ghz))

    def chip_of(self, die: int) -> int:
        return die // self.dies_per_chip

    def server_of(self, die: int) -> int:
        return die // (self.dies_per_chip * self.chips_per_server)

    def peak_cube_tflops(self, dtype: str = "bf16") -> float:
        k = {"bf16": self.cube_k_fp16, "fp16": self.cube_k_fp16, "int8": self.cube_k_int8,
             "fp32": self.cube_k_fp32}[dtype]
        macs = self.cube_m * self.cube_n * k
        return self.aic_per_die * macs * 2 * self.clock_ghz / 1e3

    def replace(self, **changes) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)


def cloudmatrix384(dies: int | None = None, **changes) -> HardwareProfile:
    """The default profile: a CloudMatrix384 die; ``dies`` limits the pod to the first N dies."""
    prof = HardwareProfile(**changes)
    if dies is not None:
        if not 1 <= dies <= 768:
            raise ValueError(f"dies={dies} out of range: a CloudMatrix384 pod has 1..768 dies")
        prof = dataclasses.replace(prof, dies=dies)
    return prof
