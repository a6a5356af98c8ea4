"""Hardware profile: every timing and capacity constant of the emulated machine, and nothing else.

A profile is a frozen value: copy and change it with ``dataclasses.replace(cloudmatrix384(), hbm_gbps=1200)`` or
``prof.replace(...)``, save it with ``prof.to_toml(path)`` and load it with ``HardwareProfile.from_toml(path)``.
Only the instruction/timing layer reads it. ``SOURCES`` says where every field's value comes from: a CANN platform
file, a document, a paper, an estimate (with its reasoning) or a calibration fit (DESIGN.md 9).
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_INI_93 = "CANN platform file Ascend910_9391.ini (the CloudMatrix384 die, Short_SoC_version=Ascend910_93)"
_RATES = f"{_INI_93} [AICoreMemoryRates], bytes per cycle per core"

# Where each field's default comes from. "estimate:" values carry their reasoning; "fit:" values come from
# kernels.calibrate.fit over the calibration set of DESIGN.md 9 and nothing else.
SOURCES = {
    "name": "label",
    "soc_version": f"{_INI_93} [version] SoC_version",
    "dies": "CloudMatrix384 paper: 48 servers x 8 chips x 2 dies",
    "dies_per_chip": "CloudMatrix384 paper: Ascend 910C = two dies in one package",
    "chips_per_server": "CloudMatrix384 paper: 8 NPUs per server",
    "aic_per_die": f"{_INI_93} [SoCInfo] cube_core_cnt=24",
    "aiv_per_die": f"{_INI_93} [SoCInfo] vector_core_cnt=48",
    "aiv_per_aic": "Ascend C docs: in MIX mode an AIC pairs with two AIVs (cube_vector_combine=split)",
    "clock_ghz": f"{_INI_93} [AICoreSpec] cube_freq=1850 (MHz)",
    "ub_bytes": f"{_INI_93} [AICoreSpec] ub_size=196608",
    "ub_align": f"{_INI_93} [AICoreSpec] ubblock_size=32",
    "l1_bytes": f"{_INI_93} [AICoreSpec] l1_size=524288",
    "l1_align": "Ascend C docs: L1 addresses 32-byte aligned",
    "l0a_bytes": f"{_INI_93} [AICoreSpec] l0_a_size=65536",
    "l0b_bytes": f"{_INI_93} [AICoreSpec] l0_b_size=65536",
    "l0ab_align": "Ascend C docs: L0A/L0B addresses 512-byte aligned",
    "l0c_bytes": f"{_INI_93} [AICoreSpec] l0_c_size=131072",
    "l0c_align": "Ascend C docs: L0C addresses 64-byte aligned",
    "bt_bytes": f"{_INI_93} [AICoreSpec] bt_size=1024",
    "bt_align": "Ascend C docs: BT addresses 64-byte aligned",
    "fb_bytes": f"{_INI_93} [AICoreSpec] fb0..fb3_size = 2048+1024+2048+2048",
    "fb_align": "Ascend C docs: FB addresses 64-byte aligned",
    "cube_m": f"{_INI_93} [AICoreSpec] cube_m_size=16",
    "cube_n": f"{_INI_93} [AICoreSpec] cube_n_size=16",
    "cube_k_fp16": f"{_INI_93} [DtypeMKN] Default=16,16,16",
    "cube_k_int8": f"{_INI_93} [DtypeMKN] DT_INT8=16,32,16",
    "cube_k_fp32": "Ascend C docs: fp32 mmad uses 16x8x16 fractals",
    "cube_startup_cycles": "estimate: a few tens of cycles to start an mmad (operand fetch from L0A/L0B)",
    "vec_bytes_per_repeat": f"{_INI_93} [AICoreSpec] vec_calc_size=128 (fp16 lanes) = 256 bytes per repeat",
    "vec_max_repeat": "Ascend C docs: repeatTimes is 8 bits (<= 255)",
    "vec_startup_cycles": "estimate: vector instruction issue and pipeline fill, tens of cycles",
    "issue_cycles": "estimate: scalar cost to set up and dispatch one pipe instruction",
    "scalar_op_cycles": "estimate: one scalar ALU op per cycle",
    "hbm_read_bytes_per_cycle": f"{_RATES}: ddr_read_rate=32",
    "hbm_write_bytes_per_cycle": f"{_RATES}: ddr_write_rate=32",
    "l2_read_bytes_per_cycle": f"{_RATES}: l2_read_rate=110",
    "l2_write_bytes_per_cycle": f"{_RATES}: l2_write_rate=86",
    "ub_to_l2_bytes_per_cycle": f"{_RATES}: ub_to_l2_rate=64",
    "ub_to_hbm_bytes_per_cycle": f"{_RATES}: ub_to_ddr_rate=64",
    "l1_to_l0a_bytes_per_cycle": f"{_RATES}: l1_to_l0_a_rate=512",
    "l1_to_l0b_bytes_per_cycle": f"{_RATES}: l1_to_l0_b_rate=256",
    "l1_to_ub_bytes_per_cycle": f"{_RATES}: l1_to_ub_rate=128",
    "l0c_to_ub_bytes_per_cycle": f"{_RATES}: l0_c_to_ub_rate=256",
    "ub_to_l1_bytes_per_cycle": f"{_RATES}: ub_to_l1_rate=128",
    "l0c_to_l1_bytes_per_cycle": "estimate: the platform file gives no L0C->L1 rate; 128 B/cycle, the rate it gives "
                                 "for the other copies into L1 (ub_to_l1_rate)",
    "ub_to_ub_bytes_per_cycle": "estimate: the platform file gives no UB->UB rate; 128 B/cycle like l1_to_ub_rate",
    "mte_startup_cycles": "fit (kernels.calibrate.fit): the fixed cost of one MTE copy beyond its bytes and latency "
                          "(DESIGN.md 3.1's mtu start); the fit over 0..32 cycles is flat on dispatch / combine and "
                          "the GEMM point prefers 0: a copy's set-up overlaps the previous copy of its pipe",
    "burst_bytes": "Ascend C docs: DataCopy moves whole 32-byte blocks",
    "hbm_bytes": f"{_INI_93} [SoCInfo] memory_size=68719476736",
    "hbm_gbps": "CloudMatrix384 paper / public 910C figures: about 1.6 TB/s of HBM per die",
    "l2_bytes": f"{_INI_93} [SoCInfo] l2_size=201326592 (192 MiB per die)",
    "l2_line_bytes": "estimate: 512 B, the GM access granule CANN's tuning guides ask addresses to be aligned to; "
                     "the platform file gives no line size",
    "l2_gbps": "fit (kernels.calibrate.fit_l2_gbps): not published; the grouped-GEMM point of DESIGN.md 9 bounds it "
               "from below (the cores' movers and the cube bind above about 5 TB/s), so the fit is that bound",
    "remote_outstanding_bytes": "estimate: 64 KiB in flight per mover to a remote die (about 128 requests of 512 "
                                "B, the order of a core's bus interface); no public figure",
    "fabric_gbps": "CloudMatrix384 paper: about 196 GB/s per direction per die on the Unified Bus",
    "inter_node_bw_loss": "CloudMatrix384 paper: inter-node traffic loses < 3 % bandwidth",
    "d2d_gbps": "CloudMatrix384 paper: about 224 GB/s between the two dies of a chip",
    "pair_link_gbps": "none on CloudMatrix384: the Unified Bus is switched, a pair is limited only by the ports",
    "dma_engines_per_die": "estimate: one DMA engine per die serves a kernel's descriptors",
    "dma_gbps": "estimate: the DMA engine streams at the fabric port rate",
    "gm_latency_ns": "estimate: load-to-use of a GM access that misses the L2 (HBM); several hundred ns on "
                     "Ascend-class dies",
    "l2_latency_ns": "estimate: load-to-use of an L2 hit, about half the HBM figure as on GPUs of the same class; "
                     "also the latency of scalar flag / counter accesses (hot words live in the L2)",
    "fabric_latency_ns": "estimate: one Unified-Bus hop inside a server; the paper gives inter-node < 1 us extra",
    "d2d_latency_ns": "estimate: half a fabric hop between the two dies of one package",
    "inter_node_latency_ns": "CloudMatrix384 paper: inter-node adds < 1 us; 0.6 us chosen inside that bound",
    "dma_startup_ns": "estimate: DMA descriptors and doorbell cost several us, far above the mtu path",
    "flag_latency_ns": "estimate: an AIC <-> AIV cross-core flag crosses the core pair's sync unit in tens of ns",
    "barrier_ns": "estimate: SyncAll among a die's cores, an atomic round trip plus a poll",
    "comm_start_us": "fit (kernels.calibrate.fit): least squares over the 12 dispatch / combine points of DESIGN.md 9; "
                     "the residual device-side start of the fused dispatch/combine operators the model does not "
                     "detail; applied to those operators only. 44.6 (was 43.6): refit after the staged cross-die "
                     "transfers as the least-squares offset (the mean residual) over those 12 points at the fit's "
                     "start-up and L2 rate, which the single-die GEMM point sets and the staging did not move",
    "launch_single_op_us": "estimate: host-side dispatch of one kernel in single-op mode",
    "launch_graph_us": "estimate: per-kernel cost when the kernel runs inside a captured graph",
    "cross_core_flag_max": "Ascend C docs: a cross-core flag counter holds 15 sets",
}
# the fitted parameters and their fit (kept for callers that read the calibration notes by name)
CALIBRATION = {k: v for k, v in SOURCES.items() if v.startswith(("fit", "estimate"))}


@dataclass(frozen=True)
class HardwareProfile:
    """One die of an Ascend 910-class chip plus the pod around it. Units are in the field names."""

    name: str = "cloudmatrix384-die"
    soc_version: str = "Ascend910_9391"
    # --- pod topology: CloudMatrix384 = 48 servers x 8 chips x 2 dies
    dies: int = 768
    dies_per_chip: int = 2
    chips_per_server: int = 8
    # --- cores per die; each AIC pairs with 2 AIV (MIX mode)
    aic_per_die: int = 24
    aiv_per_die: int = 48
    aiv_per_aic: int = 2
    clock_ghz: float = 1.85
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
    # --- one core's data movers, by where the bytes come from and go to (bytes per cycle)
    hbm_read_bytes_per_cycle: int = 32     # GM -> core, bytes that miss the L2
    hbm_write_bytes_per_cycle: int = 32
    l2_read_bytes_per_cycle: int = 110     # GM -> core, bytes that hit the L2
    l2_write_bytes_per_cycle: int = 86     # L0C -> GM (fixpipe) into the L2
    ub_to_l2_bytes_per_cycle: int = 64     # UB -> GM (mtu-out) into the L2
    ub_to_hbm_bytes_per_cycle: int = 64
    l1_to_l0a_bytes_per_cycle: int = 512
    l1_to_l0b_bytes_per_cycle: int = 256
    l1_to_ub_bytes_per_cycle: int = 128
    l0c_to_ub_bytes_per_cycle: int = 256
    ub_to_l1_bytes_per_cycle: int = 128
    l0c_to_l1_bytes_per_cycle: int = 128
    ub_to_ub_bytes_per_cycle: int = 128
    mte_startup_cycles: int = 0      # fit (SOURCES)
    burst_bytes: int = 32            # copies move whole 32-byte bursts per block
    # --- shared memory system (GB/s = 1e9 bytes/s)
    hbm_bytes: int = 64 * GiB
    hbm_gbps: float = 1600.0
    l2_bytes: int = 192 * MiB
    l2_line_bytes: int = 512
    l2_gbps: float = 5008.0          # aggregate L2 bandwidth of a die (fit: a lower bound)
    remote_outstanding_bytes: int = 64 * KiB
    fabric_gbps: float = 196.0       # Unified-Bus, per direction per die
    inter_node_bw_loss: float = 0.03
    d2d_gbps: float = 224.0          # the two dies of one chip
    pair_link_gbps: float = 0.0      # > 0: each pair of chips has its own link of this rate (a full mesh)
    dma_engines_per_die: int = 1
    dma_gbps: float = 196.0
    # --- latencies (estimates and calibration parameters, see SOURCES)
    gm_latency_ns: float = 400.0     # a GM access that misses the L2
    l2_latency_ns: float = 200.0     # one that hits it
    fabric_latency_ns: float = 1200.0
    d2d_latency_ns: float = 600.0
    inter_node_latency_ns: float = 600.0
    dma_startup_ns: float = 4000.0
    flag_latency_ns: float = 60.0    # AIC <-> AIV cross-core flag
    barrier_ns: float = 800.0        # SyncAll among the cores of one die
    comm_start_us: float = 44.6      # residual start of the fused dispatch/combine operators (fit)
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

    # ---------------------------------------------------------------- files
    def to_toml(self, path: str | Path | None = None) -> str:
        """The profile as TOML (every field, with its source as a comment); written to ``path`` if given."""
        lines = [f"# ascend-emu hardware profile '{self.name}' (HardwareProfile.from_toml reads it back)"]
        for f in dataclasses.fields(self):
            lines.append(f"# {SOURCES.get(f.name, '')}")
            lines.append(f"{f.name} = {_toml_value(getattr(self, f.name))}")
        text = "\n".join(lines) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_toml(cls, path: str | Path) -> "HardwareProfile":
        """Read a profile file. ``preset = "NAME"`` starts from a preset (default: cloudmatrix384); every other
        key overrides that field. Unknown keys and wrong types raise ``ArgumentError`` naming the key."""
        from .errors import ArgumentError
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ArgumentError(f"profile file {str(p)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ArgumentError(f"profile file {str(p)!r} is not valid TOML: {e}") from None
        base_name = data.pop("preset", "cloudmatrix384")
        if base_name not in PRESETS:
            raise ArgumentError(f"profile file {str(p)!r}: preset={base_name!r}; use one of {sorted(PRESETS)}")
        base = PRESETS[base_name]()
        types = {f.name: type(getattr(base, f.name)) for f in dataclasses.fields(base)}
        changes = {}
        for key, value in data.items():
            if key not in types:
                raise ArgumentError(f"profile file {str(p)!r}: unknown key {key!r} (fields: see "
                                    f"HardwareProfile, e.g. {', '.join(list(types)[:4])}, ...)")
            want = types[key]
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ArgumentError(f"profile file {str(p)!r}: {key} = {value!r} must be of type {want.__name__}")
            changes[key] = value
        return dataclasses.replace(base, **changes)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def cloudmatrix384(dies: int | None = None, **changes) -> HardwareProfile:
    """The default profile: a CloudMatrix384 die (``Ascend910_9391``); ``dies`` limits the pod to the first N."""
    prof = HardwareProfile(**changes)
    if dies is not None:
        if not 1 <= dies <= 768:
            raise ValueError(f"dies={dies} out of range: a CloudMatrix384 pod has 1..768 dies")
        prof = dataclasses.replace(prof, dies=dies)
    return prof


# Ascend 910B2C in an 8-NPU server (Atlas 800T A2 class): one die per chip, HCCS full mesh between the chips.
_INI_B2C = "CANN platform file Ascend910B2C.ini (Short_SoC_version=Ascend910B)"
SOURCES_910B = {
    "soc_version": f"{_INI_B2C} [version] SoC_version",
    "clock_ghz": f"{_INI_B2C} [AICoreSpec] cube_freq=1800 (MHz); every other core, buffer, L2 and per-core rate "
                 f"figure of that file equals the Ascend910_9391 one",
    "dies": "Atlas 800T A2 class server: 8 NPUs",
    "dies_per_chip": "Ascend 910B: one die per chip",
    "hbm_bytes": "estimate: the platform file leaves memory_size empty; 64 GB HBM per public 910B2 figures",
    "fabric_gbps": "public Atlas 800T A2 figures: HCCS 392 GB/s per NPU both directions = 196 per direction",
    "pair_link_gbps": "public Atlas 800T A2 figures: full mesh of 7 HCCS links per NPU, 56 GB/s each both "
                      "directions = 28 per direction",
}


def ascend910b(dies: int | None = None, **changes) -> HardwareProfile:
    """A 910B2C-class die (``Ascend910B2C``) in an 8-NPU server: 1.8 GHz, one die per chip, HCCS full mesh."""
    base = dict(name="ascend910b-die", soc_version="Ascend910B2C", dies=8, dies_per_chip=1, chips_per_server=8,
                clock_ghz=1.8, pair_link_gbps=28.0)
    base.update(changes)
    prof = HardwareProfile(**base)
    if dies is not None:
        if not 1 <= dies <= 8:
            raise ValueError(f"dies={dies} out of range: an Ascend 910B server has 1..8 dies")
        prof = dataclasses.replace(prof, dies=dies)
    return prof


PRESETS = {"cloudmatrix384": cloudmatrix384, "ascend910b": ascend910b}


def load_profile(spec: str | Path | HardwareProfile | None, dies: int | None = None) -> HardwareProfile:
    """A profile from a preset name (``cloudmatrix384``, ``ascend910b``), a TOML file path, or a profile (as is);
    None gives the default. What ``--profile NAME|FILE`` takes on the command line. ``dies``: a pod of the profile's
    first ``dies`` dies (ArgumentError when its pod has fewer)."""
    from .errors import ArgumentError
    if spec is None:
        prof = cloudmatrix384()
    elif isinstance(spec, HardwareProfile):
        prof = spec
    elif str(spec) in PRESETS:
        prof = PRESETS[str(spec)]()
    elif str(spec).endswith(".toml") or Path(spec).exists():
        prof = HardwareProfile.from_toml(spec)
    else:
        raise ArgumentError(f"profile {str(spec)!r}: not a preset ({', '.join(sorted(PRESETS))}) or a .toml file")
    if dies is None:
        return prof
    if not 1 <= dies <= prof.dies:
        raise ArgumentError(f"dies={dies} out of range: profile {prof.name!r} has 1..{prof.dies} dies")
    return prof.replace(dies=dies)
