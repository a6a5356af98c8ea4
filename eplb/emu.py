"""eplb on the emulator: the Collect kernel and a modeled live reconfiguration. The only eplb module that imports
ascend_emu (``import eplb.emu``).

- ``collect``: each AIV loads its share of a die's top-k ids [tokens, k] int32 into UB, counts them and atomically
  adds its counts [E] into a GM buffer (a row of [slices, layers, E]), so a modeled decode step includes it.
- ``model_reconfig``: decode steps (an HBM-bound stand-in for the expert GEMMs' weight reads) run on AIVs 0..7 of
  every die that gets new weights, while one AIV per die drives the reconfiguration with its DMA engine: prefetch
  each new expert from a die holding it into a staging buffer, then (after a step boundary published the disabled
  mapping) copy staging -> slot; the next boundary re-enables. The step boundaries, flags and DMA contention are all
  simulated; the resulting per-slot durations (in steps) replay through ``LiveReconfig`` and its checker.
"""
from __future__ import annotations

import numpy as np

from ascend_emu import Pod, cloudmatrix384, kernel

from . import validate
from .errors import EplbError
from .reconfig import LiveReconfig, check_no_unloaded_routes

COUNT_CYCLES_PER_ID = 4      # modeled as a scalar read-modify-write per id; the real kernel may vectorise it


@kernel(cores="aiv")
def collect(ctx, ids_gm, counts_gm, rows_per_core: int):
    """ids_gm [T, k] int32 (one layer's gating output on this die) -> counts_gm [E] int32 += tokens per expert.
    Core b counts rows [b * rows_per_core, ...); ids < 0 are padding."""
    num_experts = counts_gm.shape[0]
    lo = ctx.block_idx * rows_per_core
    hi = min(lo + rows_per_core, ids_gm.shape[0])
    if hi <= lo:
        return
    k = ids_gm.shape[1]
    ids_t = ctx.ub.alloc((hi - lo, k), "int32", phantom=False, name="ids")       # control data: always real
    cnt_t = ctx.ub.alloc((num_experts,), "int32", phantom=False, name="counts")
    yield ctx.copy_gm_to_ub(ids_t, ids_gm[lo:hi], pad=True)
    yield ctx.vec.duplicate(cnt_t, 0)
    ids = yield ctx.get_value(ids_t, slice(None))
    ids = np.asarray(ids).reshape(-1)
    yield ctx.scalar(COUNT_CYCLES_PER_ID * ids.size)
    counts = np.bincount(ids[ids >= 0], minlength=num_experts).astype(np.int32)
    yield ctx.set_value(cnt_t, slice(None), counts)
    yield ctx.copy_ub_to_gm(counts_gm, cnt_t, pad=True, atomic="add")


def run_collect(topk_ids, num_experts: int, *, cores: int = 8, pod: Pod | None = None) -> dict:
    """Count [dies, tokens, k] (or [tokens, k]) int ids with the Collect kernel, one launch over the dies into one
    GM buffer on die 0 (the DP group's aggregate). Returns counts [E] int64, modeled_us and the run."""
    num_experts = validate.positive(num_experts, "num_experts")
    cores = validate.positive(cores, "cores")
    ids = validate.int_array(topk_ids, "topk_ids", ndim=(2, 3), high=num_experts - 1).astype(np.int32)
    if ids.ndim == 2:
        ids = ids[None]
    if ids.ndim != 3:
        raise EplbError(f"topk_ids must be [tokens, k] or [dies, tokens, k], got {ids.shape}")
    num_dies, tokens, _ = ids.shape
    pod = pod or Pod(cloudmatrix384(dies=num_dies), trace=False)
    counts_gm = pod.alloc(0, (num_experts,), "int32", name="expert_counts")
    rows = -(-tokens // cores)
    id_gms = [pod.to_gm(d, ids[d], name=f"topk_ids{d}") for d in range(num_dies)]
    # one launch per die (each die counts its own gating output into the shared buffer)
    for d in range(num_dies):
        pod.stream(d, aiv=cores).launch(collect, (id_gms[d], counts_gm, rows))
    run = pod.synchronize()
    return {"counts": counts_gm.numpy().astype(np.int64), "modeled_us": run.modeled_us,
            "kernel_us": run.kernel_us, "run": run}


# ------------------------------------------------------------------------------------------- live reconfiguration
ROW = 4096                   # bytes per row of the phantom weight buffers
STATE_PHASE, STATE_PREFETCHED, STATE_LOADED, STATE_DISABLE_STEP, STATE_ENABLE_STEP = range(5)


@kernel(cores="aiv")
def decode_step(ctx, weights, state_gm, step: int, num_changed: int, chunk_rows: int):
    """Stand-in decode step on every die of the launch: the AIVs stream ``weights[rank]`` (the expert weights a
    step reads; HBM-bound like decode's grouped GEMMs). At the step's end core 0 of rank 0 publishes the next
    mapping when the reconfiguration is ready for it: disabled once every prefetch landed, enabled once every
    load landed (the host's mapping switch, modeled as a GM store between steps)."""
    w = weights[ctx.rank]
    t = ctx.ub.alloc((2, chunk_rows, ROW), "uint8", name="w")
    rows = w.shape[0]
    for i, r in enumerate(range(ctx.block_idx * chunk_rows, rows, ctx.block_num * chunk_rows)):
        n = min(chunk_rows, rows - r)
        yield ctx.copy_gm_to_ub(t[i % 2, :n], w[r:r + n])
    yield ctx.barrier()
    if ctx.rank == 0 and ctx.block_idx == 0:
        st = yield ctx.gm_load(state_gm)
        if st[STATE_PHASE] == 0 and st[STATE_PREFETCHED] == num_changed:
            yield ctx.gm_store(state_gm[STATE_DISABLE_STEP:STATE_DISABLE_STEP + 1], step)
            yield ctx.gm_store(state_gm[STATE_PHASE:STATE_PHASE + 1], 1)
        elif st[STATE_PHASE] == 1 and st[STATE_LOADED] == num_changed:
            yield ctx.gm_store(state_gm[STATE_ENABLE_STEP:STATE_ENABLE_STEP + 1], step)
            yield ctx.gm_store(state_gm[STATE_PHASE:STATE_PHASE + 1], 2)


@kernel(cores="aiv")
def reconfig_dma(ctx, jobs, state_gm, times):
    """One AIV per target die drives its DMA engine: phase 1 prefetch source -> staging for each of its slots,
    then wait for the disabled mapping (phase 2), phase 3 staging -> slot; counts progress in ``state_gm``."""
    mine = jobs[ctx.rank]
    for staging, src, _ in mine:
        yield ctx.dma_copy(staging, src)
    yield ctx.pipe_barrier()
    times.setdefault("prefetch_us", {})[ctx.rank] = ctx.now_us
    yield ctx.atomic_add(state_gm[STATE_PREFETCHED:STATE_PREFETCHED + 1], len(mine))
    yield ctx.wait_gm(state_gm[STATE_PHASE:STATE_PHASE + 1], "ge", 1, timeout_us=None)
    times.setdefault("disabled_seen_us", {})[ctx.rank] = ctx.now_us
    for staging, _, slot in mine:
        yield ctx.dma_copy(slot, staging)
    yield ctx.pipe_barrier()
    times.setdefault("load_us", {})[ctx.rank] = ctx.now_us
    yield ctx.atomic_add(state_gm[STATE_LOADED:STATE_LOADED + 1], len(mine))


def model_reconfig(old, new, num_gpus: int, *, expert_bytes: int = 3 * 7168 * 2048, step_bytes: int = 32 << 20,
                   max_steps: int = 64, decode_cores: int = 8) -> dict:
    """Model one reconfiguration round of old -> new (phy2log [P] or [layers, P] on ``num_gpus`` dies) on the
    emulator, overlapping decode steps. Each changed slot costs two DMAs of ``expert_bytes`` (default: one
    DeepSeek-V3 routed expert in INT8): source die -> staging, staging -> slot. Returns step times, the steps at
    which the mapping was disabled / re-enabled, per-slot durations in steps, and the replayed step records
    (checked: no token reaches an unloaded slot)."""
    old = np.atleast_2d(validate.int_array(old, "old", ndim=(1, 2), low=-1))
    new = np.atleast_2d(validate.int_array(new, "new", ndim=(1, 2), low=-1))
    num_gpus = validate.positive(num_gpus, "num_gpus")
    rc = LiveReconfig(old, new)
    if len(rc.rounds) > 1:
        raise EplbError(f"old -> new needs {len(rc.rounds)} rounds; model_reconfig models one (rebalance with "
                        f"previous=old to keep a replica of every expert in place)")
    num_layers, num_slots = old.shape
    if num_slots % num_gpus:
        raise EplbError(f"num_gpus={num_gpus} must divide the {num_slots} physical slots")
    slots = num_slots // num_gpus
    changed = rc.changed
    final = rc.rounds[0][1] if rc.rounds else None
    if not len(changed):
        return {"changed_slots": 0, "rounds": 0, "steps": [], "reconfig_us": 0.0}
    layer_of, slot_of = np.divmod(changed, num_slots)
    target = slot_of // slots
    source = []
    sends = np.zeros(num_gpus, dtype=np.int64)
    for layer, s, x in zip(layer_of, slot_of, final):
        holders = np.flatnonzero(old[layer] == x)
        if not len(holders):
            raise EplbError(f"expert {x} of layer {layer} has no replica in the old layout to copy from")
        dies = holders // slots
        src = int(dies[np.lexsort((np.abs(dies - s // slots), sends[dies]))[0]])   # least-used, then closest holder
        sends[src] += 1
        source.append(src)
    tdies = sorted(set(target.tolist()))
    pod = Pod(cloudmatrix384(dies=max(tdies + source) + 1), trace=False)
    rows = -(-expert_bytes // ROW)
    jobs = {r: [] for r in range(len(tdies))}
    for i, (d, src) in enumerate(zip(target, source)):
        r = tdies.index(int(d))
        jobs[r].append((pod.alloc(int(d), (rows, ROW), "uint8", phantom=True, name=f"staging{i}"),
                        pod.alloc(src, (rows, ROW), "uint8", phantom=True, name=f"src{i}"),
                        pod.alloc(int(d), (rows, ROW), "uint8", phantom=True, name=f"slot{i}")))
    weights = [pod.alloc(d, (-(-step_bytes // ROW), ROW), "uint8", phantom=True, name="step_weights")
               for d in tdies]
    state = pod.alloc(tdies[0], (8,), "int32", name="reconfig_state")
    times: dict = {}
    dec = pod.stream(dies=tdies, aiv=list(range(decode_cores)), mode="graph")
    ctl = pod.stream(dies=tdies, aiv=[pod.profile.aiv_per_die - 1], mode="graph")
    ctl.launch(reconfig_dma, (jobs, state, times), numeric=False, name="reconfig")
    for k in range(max_steps):
        dec.launch(decode_step, (weights, state, k, len(changed), 16), numeric=False, name=f"decode{k}")
    from ascend_emu import DeadlockError
    try:
        run = pod.synchronize()
    except DeadlockError as e:
        raise EplbError(f"reconfiguration did not finish within max_steps={max_steps} decode steps; raise "
                        f"max_steps ({str(e).splitlines()[0]})") from e
    st = state.numpy()
    if st[STATE_PHASE] != 2:
        raise EplbError(f"reconfiguration did not finish within max_steps={max_steps} decode steps "
                        f"(phase {st[STATE_PHASE]}); raise max_steps")
    steps = [la for la in run.launches if la.name.startswith("decode")]
    ends = np.array([la.end_us for la in steps])
    step_us = np.array([la.duration_us for la in steps])
    dis, ena = int(st[STATE_DISABLE_STEP]), int(st[STATE_ENABLE_STEP])
    r_of = {int(d): tdies.index(int(d)) for d in target}
    pf_steps = np.array([int(np.searchsorted(ends, times["prefetch_us"][r_of[int(d)]])) + 1 for d in target])
    ld_steps = np.array([int(np.searchsorted(ends, times["load_us"][r_of[int(d)]])) - dis for d in target])
    replay = rc.run(pf_steps, np.maximum(ld_steps, 1), serve_before=0, serve_after=1)
    check_no_unloaded_routes(replay)
    after = step_us[ena + 1:]
    return {
        "changed_slots": int(len(changed)), "rounds": 1, "dies": tdies, "source_dies": sorted(set(source)),
        "expert_bytes": rows * ROW, "disable_step": dis, "enable_step": ena,
        "prefetch_steps": pf_steps.tolist(), "load_steps": ld_steps.tolist(),
        "step_us": step_us[:ena + 2].tolist(), "reconfig_us": float(ends[ena] - steps[0].start_us),
        "step_us_during": float(step_us[:ena + 1].mean()),
        "step_us_after": float(after.mean()) if len(after) else None,
        "replay": replay, "run": run,
    }
