"""Every user-facing error: the right EmulatorError subclass, and a message that names the limit, the number asked
for and where (kernel, die, core) it happened."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ascend_emu.errors import ArgumentError
from ascend_emu import (AddressError, AlignmentError, CapacityError, DeadlockError, DTypeError, EmulatorError,
                        HazardError, KernelError, Pod, ShapeError, cloudmatrix384, kernel)

PROF = cloudmatrix384(dies=2)


def launch_error(k, exc, *, gm=(), dies=2, **kw):
    """Launch ``k`` on a fresh pod with GM tensors made by ``gm`` [(die, shape, dtype)]; return the message of the
    ``exc`` it must raise."""
    pod = Pod(cloudmatrix384(dies=dies))
    args = tuple(pod.alloc(d, s, t) for d, s, t in gm)
    with pytest.raises(exc) as ei:
        pod.launch(k, args=args, **kw)
    return str(ei.value), ei.value


# ---------------------------------------------------------------------------------------------- capacity
def test_ub_over_allocation_names_capacity_and_request():
    @kernel(cores="aiv")
    def too_big(ctx):
        ctx.ub.alloc((200 * 1024,), "uint8", name="huge")
        yield ctx.scalar(1)

    msg, _ = launch_error(too_big, CapacityError, aiv=[7])
    assert "UB" in msg and "196608" in msg and "204800" in msg and "huge" in msg
    assert "kernel 'too_big' die 0 aiv 7" in msg


def test_ub_over_allocation_counts_what_is_already_used():
    @kernel(cores="aiv")
    def two_halves(ctx):
        ctx.ub.alloc((100 * 1024,), "uint8")
        ctx.ub.alloc((100 * 1024,), "uint8")            # fits alone, not after the first
        yield ctx.scalar(1)

    msg, _ = launch_error(two_halves, CapacityError, aiv=1)
    assert "102400 of 196608 bytes already used" in msg and "94208 free" in msg


def test_ub_alignment_padding_counts_against_capacity():
    @kernel(cores="aiv")
    def padded(ctx):
        for _ in range(196608 // 32):
            ctx.ub.alloc((1,), "fp32")                   # 4 bytes, padded to 32
        ctx.ub.alloc((1,), "fp32")
        yield ctx.scalar(1)

    msg, _ = launch_error(padded, CapacityError, aiv=1)
    assert "196608 of 196608 bytes already used" in msg and "aligned to 32" in msg


def test_l0c_over_allocation_names_128_kib():
    @kernel(cores="aic")
    def big_acc(ctx):
        ctx.l0c.alloc((256, 256), "fp32")
        yield ctx.scalar(1)

    msg, _ = launch_error(big_acc, CapacityError, aic=1)
    assert "L0C" in msg and "131072" in msg and "262144" in msg and "die 0 aic 0" in msg


def test_gm_capacity_exhaustion_names_64_gib():
    pod = Pod(cloudmatrix384(dies=1))
    pod.alloc(0, (40 << 30,), "uint8", phantom=True)         # phantom: address space only
    with pytest.raises(CapacityError) as ei:
        pod.alloc(0, (30 << 30,), "uint8", phantom=True, name="kv_cache")
    msg = str(ei.value)
    assert str(64 << 30) in msg and str(30 << 30) in msg and "kv_cache" in msg and "die 0" in msg
    with pytest.raises(CapacityError, match=str(64 << 30)):
        Pod(cloudmatrix384(dies=1)).alloc(0, (65 << 30,), "uint8", phantom=True)


# ---------------------------------------------------------------------------------------------- alignment
def test_l0a_tile_off_a_512_byte_boundary_is_rejected():
    @kernel(cores="aic")
    def odd_l0a(ctx, a_gm):
        a_l1 = ctx.l1.alloc((16, 32), "int8")
        a_l0 = ctx.l0a.alloc((2, 16, 32), "int8")                 # 512 bytes per slot
        yield ctx.copy_gm_to_l1(a_l1, a_gm)
        off = a_l0.reshape(-1)[32:32 + 512].reshape(16, 32)       # starts at byte 32
        yield ctx.copy_l1_to_l0a(off, a_l1)

    msg, _ = launch_error(odd_l0a, AlignmentError, gm=[(0, (16, 32), "int8")], aic=1)
    assert "512" in msg and "L0A" in msg


def test_copy_of_20_byte_rows_without_pad_names_32_byte_bursts():
    @kernel(cores="aiv")
    def rows20(ctx, x):
        t = ctx.ub.alloc((4, 5), "fp32")
        yield ctx.copy_gm_to_ub(t, x[:, :5])                      # 4 rows of 5 fp32 = 20 bytes

    msg, _ = launch_error(rows20, AlignmentError, gm=[(0, (4, 8), "fp32")], aiv=1)
    assert "4 block(s) of 20 bytes" in msg and "32" in msg and "pad=True" in msg
    assert "kernel 'rows20' die 0 aiv 0" in msg


def test_same_copy_with_pad_is_accepted_and_moves_the_data():
    @kernel(cores="aiv")
    def rows20_pad(ctx, x, y):
        t = ctx.ub.alloc((4, 5), "fp32")
        yield ctx.copy_gm_to_ub(t, x[:, :5], pad=True)
        yield ctx.copy_ub_to_gm(y[:, 3:8], t, pad=True)

    pod = Pod(cloudmatrix384(dies=1))
    data = np.arange(32, dtype=np.float32).reshape(4, 8)
    x, y = pod.to_gm(0, data), pod.alloc(0, (4, 8), "fp32")
    pod.launch(rows20_pad, aiv=1, args=(x, y))
    assert np.array_equal(y.numpy()[:, 3:8], data[:, :5]) and (y.numpy()[:, :3] == 0).all()


def test_ub_tile_at_a_misaligned_offset():
    @kernel(cores="aiv")
    def off16(ctx, x):
        t = ctx.ub.alloc((64,), "fp32")
        yield ctx.copy_gm_to_ub(t[4:12], x)                       # byte 16 of the allocation

    msg, _ = launch_error(off16, AlignmentError, gm=[(0, (8,), "fp32")], aiv=1)
    assert "starts at byte 16" in msg and "32-byte UB alignment" in msg


# ---------------------------------------------------------------------------------------------- addresses
def test_gm_slice_out_of_range_names_the_dim_size():
    @kernel(cores="aiv")
    def past_end(ctx, x):
        t = ctx.ub.alloc((8, 8), "fp32")
        yield ctx.copy_gm_to_ub(t, x[60:68])

    msg, _ = launch_error(past_end, AddressError, gm=[(0, (64, 8), "fp32")], aiv=1)
    assert "60:68" in msg and "dim 0 of size 64" in msg and "die 0 aiv 0" in msg


def test_gm_index_and_column_out_of_range():
    pod = Pod(cloudmatrix384(dies=1))
    x = pod.alloc(0, (64, 8), "fp32", name="x")
    with pytest.raises(AddressError, match=r"index 64 out of range for dim 0 of size 64"):
        x[64]
    with pytest.raises(AddressError, match=r"dim 1 of size 8"):
        x[:, 4:9]


@pytest.mark.parametrize("where", ["alloc", "to_gm", "launch", "stream"])
def test_die_out_of_range_names_the_pods_dies(where):
    pod = Pod(cloudmatrix384(dies=2))
    with pytest.raises(AddressError) as ei:
        if where == "alloc":
            pod.alloc(2, (8,), "fp32")
        elif where == "to_gm":
            pod.to_gm(5, np.zeros(8, np.float32))
        elif where == "launch":
            pod.launch(kernel(lambda ctx: (yield ctx.scalar(1))), die=3, aiv=1)
        else:
            pod.stream(dies=[0, 1, 2], aiv=1)
    msg = str(ei.value)
    assert re.search(r"die \d out of range", msg) and "dies 0..1" in msg


@pytest.mark.parametrize("spec, limit", [(49, "48 AIV"), ([0, 48], "0..47")])
def test_core_count_or_index_out_of_range(spec, limit):
    pod = Pod(cloudmatrix384(dies=1))
    with pytest.raises(AddressError, match=limit):
        pod.stream(0, aiv=spec)


def test_gather_row_out_of_range_host_list_and_index_tile():
    @kernel(cores="aiv")
    def gather_host(ctx, x):
        t = ctx.ub.alloc((2, 8), "fp32")
        yield ctx.gather_gm_to_ub(t, x, [3, 40])

    msg, _ = launch_error(gather_host, AddressError, gm=[(0, (32, 8), "fp32")], aiv=1)
    assert "row index 40 out of range 0..31" in msg

    @kernel(cores="aiv")
    def gather_tile(ctx, x, idx_gm):
        t = ctx.ub.alloc((8, 8), "fp32")
        idx = ctx.ub.alloc((8,), "int32")
        yield ctx.copy_gm_to_ub(idx, idx_gm)
        yield ctx.gather_gm_to_ub(t, x, idx)

    pod = Pod(cloudmatrix384(dies=1))
    x = pod.alloc(0, (32, 8), "fp32")
    idx = pod.to_gm(0, np.array([0, 1, 2, 3, 4, 5, 6, -1], np.int32))
    # read when the gather starts (not checkable when issued), so the instruction and time are in the location
    with pytest.raises(AddressError, match=r"row index -1 out of range 0\.\.31.*\[kernel 'gather_tile' die 0 aiv 0, "
                                           r"gather_gm_to_ub at [\d.]+ us\]"):
        pod.launch(gather_tile, aiv=1, args=(x, idx))


def test_pod_gm_at_outside_any_allocation():
    pod = Pod(cloudmatrix384(dies=1))
    a = pod.alloc(0, (100,), "uint8")                    # occupies [0, 100), padded to 512
    assert pod.gm_at(0, a.addr + 96, (4,), "uint8").store is a.store
    for addr, n in ((96, 8), (512 + 4, 8), (1 << 20, 1)):
        with pytest.raises(AddressError) as ei:
            pod.gm_at(0, addr, (n,), "uint8")
        assert f"0x{addr:x}+{n} bytes on die 0 is outside every allocation" in str(ei.value)
        assert str(64 << 30) in str(ei.value)


def test_ctx_gm_at_reads_a_raw_address_and_rejects_unallocated_ones():
    got = []

    @kernel(cores="aiv")
    def raw(ctx, addr):
        v = yield ctx.gm_load(ctx.gm_at(1, addr, (2,), "int32"))
        got.append(v.tolist())
        try:
            ctx.gm_at(1, addr + 4096, (2,), "int32")
        except AddressError as e:
            got.append(str(e))
        yield ctx.scalar(1)

    pod = Pod(cloudmatrix384(dies=2))
    t = pod.to_gm(1, np.array([5, 6, 7, 8], np.int32))
    pod.launch(raw, aiv=1, args=(t.addr + 8,))
    assert got[0] == [7, 8]
    assert "outside every allocation" in got[1]


# ---------------------------------------------------------------------------------------------- dtypes and shapes
def test_vector_add_on_bf16_is_a_dtype_error():
    @kernel(cores="aiv")
    def bf16_add(ctx):
        t = ctx.ub.alloc((8, 16), "bf16")
        yield ctx.vec.add(t, t, t)

    msg, _ = launch_error(bf16_add, DTypeError, aiv=1)
    assert "vec.add" in msg and "no bf16 arithmetic" in msg and "cast to fp32" in msg


def test_vector_operands_of_mixed_dtypes():
    @kernel(cores="aiv")
    def mixed(ctx):
        a = ctx.ub.alloc((8, 16), "fp32")
        b = ctx.ub.alloc((8, 16), "fp16")
        yield ctx.vec.mul(a, a, b)

    msg, _ = launch_error(mixed, DTypeError, aiv=1)
    assert "src1 dtype fp16 != dst dtype fp32" in msg


def test_copy_between_different_dtypes():
    @kernel(cores="aiv")
    def convert(ctx, x):
        t = ctx.ub.alloc((8, 16), "fp16")
        yield ctx.copy_gm_to_ub(t, x)

    msg, _ = launch_error(convert, DTypeError, gm=[(0, (8, 16), "fp32")], aiv=1)
    assert "dst dtype fp16 != src dtype fp32" in msg and "vec.cast" in msg


def test_shape_mismatches():
    @kernel(cores="aiv")
    def wrong_shape(ctx, x):
        t = ctx.ub.alloc((8, 16), "fp32")
        yield ctx.copy_gm_to_ub(t, x[:, :8])

    msg, err = launch_error(wrong_shape, ShapeError, gm=[(0, (8, 16), "fp32")], aiv=1)
    assert "(8, 16)" in msg and "(8, 8)" in msg

    @kernel(cores="aic")
    def bad_mmad(ctx):
        a = ctx.l0a.alloc((16, 32), "int8")
        b = ctx.l0b.alloc((64, 16), "int8")
        c = ctx.l0c.alloc((16, 16), "int32")
        yield ctx.mmad(c, a, b)

    msg, _ = launch_error(bad_mmad, ShapeError, aic=1)
    assert "(16, 32)" in msg and "(64, 16)" in msg


def test_mmad_dtype_modes():
    @kernel(cores="aic")
    def mixed_mmad(ctx):
        a = ctx.l0a.alloc((16, 16), "fp16")
        b = ctx.l0b.alloc((16, 16), "fp16")
        c = ctx.l0c.alloc((16, 16), "int32")
        yield ctx.mmad(c, a, b)

    msg, _ = launch_error(mixed_mmad, DTypeError, aic=1)
    assert "fp16" in msg and "int32" in msg and "not a cube mode" in msg


def test_atomics_need_word_dtypes():
    @kernel(cores="aiv")
    def atomic_bf16(ctx, x):
        yield ctx.atomic_add(x, 1.0)

    msg, _ = launch_error(atomic_bf16, DTypeError, gm=[(0, (1,), "bf16")], aiv=1)
    assert "atomic_add" in msg and "bf16" in msg


# ---------------------------------------------------------------------------------------------- wrong core / buffer
def test_tile_of_another_core():
    shared = {}

    @kernel(cores="aiv")
    def steal(ctx, x):
        if ctx.block_idx == 0:
            shared["tile"] = ctx.ub.alloc((8, 8), "fp32")
            yield ctx.scalar(1)
        else:
            yield ctx.copy_gm_to_ub(shared["tile"], x)

    msg, _ = launch_error(steal, AddressError, gm=[(0, (8, 8), "fp32")], aiv=2)
    assert "belongs to die 0 aiv 0, not to die 0 aiv 1" in msg


def test_tile_in_the_wrong_buffer():
    @kernel(cores="aic")
    def l0a_as_l1(ctx):
        a = ctx.l0a.alloc((16, 32), "int8")
        b = ctx.l0b.alloc((16, 32), "int8")
        yield ctx.copy_l1_to_l0b(b, a)

    msg, _ = launch_error(l0a_as_l1, AddressError, aic=1)
    assert "src is in L0A, this instruction needs L1" in msg

    @kernel(cores="aiv")
    def gm_as_tile(ctx, x, y):
        yield ctx.copy_gm_to_ub(y, x)

    msg, _ = launch_error(gm_as_tile, AddressError, gm=[(0, (8, 8), "fp32"), (0, (8, 8), "fp32")], aiv=1)
    assert "dst must be a local tile in UB" in msg


def test_ub_on_an_aic_and_l1_on_an_aiv():
    @kernel(cores="aic")
    def aic_ub(ctx):
        ctx.ub.alloc((8,), "fp32")
        yield ctx.scalar(1)

    msg, _ = launch_error(aic_ub, AddressError, aic=[3])
    assert "die 0 aic 3 has no UB" in msg

    @kernel(cores="aiv")
    def aiv_l1(ctx):
        ctx.l1.alloc((8,), "fp32")
        yield ctx.scalar(1)

    msg, _ = launch_error(aiv_l1, AddressError, aiv=1)
    assert "die 0 aiv 0 has no L1" in msg


def test_vector_instruction_on_an_aic():
    @kernel(cores="aic")
    def aic_vec(ctx):
        t = ctx.l1.alloc((8, 8), "fp32")
        yield ctx.vec.add(t, t, t)

    msg, _ = launch_error(aic_vec, AddressError, aic=1)
    assert "vec.add on die 0 aic 0" in msg and "AIV" in msg


def test_kernel_kinds_need_their_cores():
    @kernel(cores="aic")
    def cube_only(ctx):
        yield ctx.scalar(1)

    pod = Pod(cloudmatrix384(dies=1))
    with pytest.raises(AddressError, match="needs AIC cores; this stream has none"):
        pod.stream(0, aic=0).launch(cube_only)


def test_cross_core_set_outside_a_mix_launch():
    @kernel(cores="aiv")
    def lonely(ctx):
        yield ctx.cross_core_set(1)

    msg, _ = launch_error(lonely, HazardError, aiv=1)
    assert "no paired core" in msg and "die 0 aiv 0" in msg


def test_cross_core_flag_id_out_of_range():
    @kernel(cores="mix")
    def flag16(ctx):
        yield ctx.cross_core_set(16)

    msg, err = launch_error(flag16, ArgumentError, aic=1)   # an EmulatorError and a ValueError, with location
    assert "16 out of range 0..15" in msg and "die 0 aic 0" in msg
    assert isinstance(err, ValueError)


def test_dma_engine_out_of_range():
    @kernel(cores="aiv")
    def dma2(ctx, a, b):
        yield ctx.dma_copy(b, a, engine=2)

    msg, _ = launch_error(dma2, AddressError, gm=[(0, (64,), "fp32"), (1, (64,), "fp32")], aiv=1)
    assert "engine 2 out of range 0..0" in msg


# ---------------------------------------------------------------------------------------------- control data
def test_flags_must_be_real_in_timing_only_runs():
    @kernel(cores="aiv")
    def poll_phantom(ctx, flag):
        yield ctx.wait_gm(flag, "eq", 1)

    pod = Pod(cloudmatrix384(dies=1))
    flag = pod.alloc(0, (1,), "int32", phantom=True, name="phantom_flag")
    with pytest.raises(AddressError) as ei:
        pod.launch(poll_phantom, aiv=1, args=(flag,), numeric=False)
    assert "wait_gm on phantom" in str(ei.value) and "phantom_flag" in str(ei.value)
    assert "phantom=False" in str(ei.value)


def test_run_bound_catches_a_livelock():
    @kernel(cores="aiv")
    def spin(ctx, flag):
        while True:                                       # polls with loads instead of wait_gm: never sleeps
            v = yield ctx.gm_load(flag)
            if v[0]:
                break

    pod = Pod(cloudmatrix384(dies=1), max_modeled_us=100)
    flag = pod.alloc(0, (1,), "int32")
    with pytest.raises(DeadlockError) as ei:
        pod.launch(spin, aiv=1, args=(flag,))
    assert "bound of 100.0 us" in str(ei.value)


# ---------------------------------------------------------------------------------------------- kernel bugs
def test_kernel_that_is_not_a_generator():
    @kernel(cores="aiv")
    def plain(ctx, x):
        return x

    msg, _ = launch_error(plain, KernelError, gm=[(0, (8,), "fp32")], aiv=1)
    assert "kernel 'plain' is not a generator function" in msg


def test_non_generator_kernel_that_raises_at_once():
    @kernel(cores="aiv")
    def broken(ctx):
        raise RuntimeError("bad tiling")

    msg, err = launch_error(broken, KernelError, aiv=[2])
    assert "failed before its first instruction on die 0 aiv 2" in msg and "bad tiling" in msg
    assert isinstance(err.__cause__, RuntimeError)


def test_kernel_raising_a_python_exception_is_wrapped_with_location():
    @kernel(cores="aiv")
    def buggy(ctx, table):
        yield ctx.scalar(18)                              # 10 ns into the kernel
        if ctx.block_idx == 1:
            table["missing"]

    pod = Pod(cloudmatrix384(dies=2))
    with pytest.raises(KernelError) as ei:
        pod.launch(buggy, die=1, aiv=2, args=({},))
    msg, err = str(ei.value), ei.value
    assert "kernel 'buggy' raised KeyError: 'missing'" in msg
    assert "die 1 aiv 1" in msg
    t = float(re.search(r"at ([\d.]+) us", msg).group(1))
    assert t == pytest.approx(PROF.launch_single_op_us + 0.01, abs=1e-3)
    assert isinstance(err.__cause__, KeyError)
    assert isinstance(err, EmulatorError)


def test_kernel_yielding_something_else():
    @kernel(cores="aiv")
    def yields_str(ctx):
        yield "copy please"

    msg, _ = launch_error(yields_str, KernelError, aiv=1)
    assert "yielded 'copy please'" in msg and "die 0 aiv 0" in msg


# ---------------------------------------------------------------------------------------------- checks inside a kernel
@pytest.mark.parametrize("index, exc", [(8, AddressError), ((0, 1), AddressError), (-9, AddressError),
                                        ("a", ArgumentError), (1.5, ArgumentError)])
def test_get_value_index_is_checked_when_issued_with_location(index, exc):
    @kernel(cores="aiv")
    def read(ctx):
        t = ctx.ub.alloc((8,), "int32")
        yield ctx.get_value(t, index)

    msg, _ = launch_error(read, exc, aiv=[3])
    assert "get_value: index" in msg and "kernel 'read' die 0 aiv 3" in msg


@pytest.mark.parametrize("op, dtype, value, exc, says", [
    ("gm_store", "int8", 300, ArgumentError, "value 300 does not fit"),
    ("gm_store", "int32", 2 ** 31, ArgumentError, "does not fit"),
    ("gm_store", "int32", 2.5, ArgumentError, "value 2.5 does not fit"),
    ("gm_store", "int32", float("nan"), ArgumentError, "does not fit"),
    ("gm_store", "int32", 2 ** 70, ArgumentError, "does not fit"),
    ("gm_store", "int32", "one", DTypeError, "is not a number"),
    ("gm_store", "int32", np.ones(3), ShapeError, "does not broadcast"),
    ("atomic_add", "int32", -2 ** 40, ArgumentError, "does not fit"),
    ("atomic_cas", "int32", 2 ** 33, ArgumentError, "does not fit"),
    ("wait_gm", "int32", "x", DTypeError, "is not a number"),
    ("set_value", "int8", 300, ArgumentError, "value 300 does not fit"),
])
def test_scalar_values_that_do_not_fit_raise_when_issued_with_location(op, dtype, value, exc, says):
    """A flag or counter value out of its dtype's range was an OverflowError from deep inside the scheduler (or a
    silent wrap): now a library error at the kernel line that issued it."""
    @kernel(cores="aiv")
    def store(ctx, flag):
        if op == "gm_store":
            yield ctx.gm_store(flag, value)
        elif op == "atomic_add":
            yield ctx.atomic_add(flag, value)
        elif op == "atomic_cas":
            yield ctx.atomic_cas(flag, 0, value)
        elif op == "wait_gm":
            yield ctx.wait_gm(flag, "eq", value)
        else:
            t = ctx.ub.alloc((32,), dtype)
            yield ctx.set_value(t, 0, value)

    msg, _ = launch_error(store, exc, gm=[(0, (1,), dtype)], aiv=[1])
    assert says in msg and "kernel 'store' die 0 aiv 1" in msg


def test_scalar_values_that_fit_are_stored_exactly():
    @kernel(cores="aiv")
    def store(ctx, flags):
        yield ctx.gm_store(flags[0:1], 127)
        yield ctx.gm_store(flags[1:2], -128.0)            # an integral float is an integer
        yield ctx.gm_store(flags[2:4], np.array([1, 2], np.int64))

    pod = Pod(cloudmatrix384(dies=1))
    flags = pod.alloc(0, (4,), "int8")
    pod.launch(store, aiv=1, args=(flags,))
    assert flags.numpy().tolist() == [127, -128, 1, 2]


@pytest.mark.parametrize("op, scalar, exc", [("adds", 2.5, ArgumentError), ("muls", "2", DTypeError),
                                             ("duplicate", 2 ** 40, ArgumentError), ("maxs", [1, 2], ShapeError)])
def test_vector_scalars_are_numbers_that_fit_integer_tiles(op, scalar, exc):
    @kernel(cores="aiv")
    def vec(ctx):
        t = ctx.ub.alloc((8,), "int32")
        yield getattr(ctx.vec, op)(t, scalar) if op == "duplicate" else getattr(ctx.vec, op)(t, t, scalar)

    msg, _ = launch_error(vec, exc, aiv=1)
    assert f"vec.{op}" in msg and "kernel 'vec' die 0 aiv 0" in msg


# ---------------------------------------------------------------------------------------------- argument types
@pytest.mark.parametrize("dies, exc, says", [
    ([0, 0], ArgumentError, "die 0 is listed twice"),
    ([0, 1, 0], ArgumentError, "die 0 is listed twice"),
    ([], ArgumentError, "at least one die"),
    ([0, 1.0], ArgumentError, "die ids are integers"),
    ([True], ArgumentError, "die ids are integers"),
    ("01", ArgumentError, "must be a list of integers"),
    (0, ArgumentError, "must be a list of integers"),
    ([0, 2], AddressError, "die 2 out of range"),
])
def test_die_lists_are_distinct_integers_of_the_pod(dies, exc, says):
    """launch(dies=[0, 0]) ran 96 cores on a 48-core die; every die list now goes through Pod.check_dies."""
    pod = Pod(cloudmatrix384(dies=2))
    with pytest.raises(exc, match=says):
        pod.launch(kernel(lambda ctx: (yield ctx.scalar(1))), dies=dies, aiv=1)
    with pytest.raises(exc, match=says):
        pod.check_dies(dies)


@pytest.mark.parametrize("spec, exc, says", [("4", ArgumentError, "aiv='4'"), (2.0, ArgumentError, "aiv=2.0"),
                                             ([0, 1.5], ArgumentError, "got 1.5"), (True, ArgumentError, "got bool"),
                                             ([1, 1], AddressError, "list a core twice")])
def test_core_specs_are_integers(spec, exc, says):
    pod = Pod(cloudmatrix384(dies=1))
    with pytest.raises(exc, match=re.escape(says)):
        pod.stream(0, aiv=spec)


@pytest.mark.parametrize("shape, exc", [((2.5, 3), ShapeError), ((2, "3"), ShapeError), ("ab", ShapeError),
                                        (2.0, ShapeError), ((4, -1), AddressError), ((True, 2), ShapeError)])
@pytest.mark.parametrize("where", ["gm", "ub"])
def test_shapes_are_non_negative_integers(shape, exc, where):
    """A float dimension was truncated (2.5 -> 2) and a string one parsed; both are refused now."""
    pod = Pod(cloudmatrix384(dies=1))
    if where == "gm":
        with pytest.raises(exc, match="shape"):
            pod.alloc(0, shape, "fp32")
        return

    @kernel(cores="aiv")
    def alloc(ctx):
        ctx.ub.alloc(shape, "fp32")
        yield ctx.scalar(1)

    with pytest.raises(exc, match="shape"):
        pod.launch(alloc, aiv=1)


@pytest.mark.parametrize("cycles", [-5, 2.5, "3", True])
@pytest.mark.parametrize("how", ["yield", "ctx.scalar"])
def test_scalar_cycle_counts_are_non_negative_integers(cycles, how):
    """yield -5 made modeled time run backwards."""
    @kernel(cores="aiv")
    def spin(ctx):
        yield cycles if how == "yield" else ctx.scalar(cycles)

    exc = ArgumentError if how == "ctx.scalar" or cycles == -5 else KernelError     # yield 2.5: not an instruction
    msg, _ = launch_error(spin, exc, aiv=1)
    assert "die 0 aiv 0" in msg


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "uint8", "uint32", "int64"])
def test_to_gm_converts_to_integers_like_the_die_saturating(dtype):
    """to_gm(x, dtype=int8) wrapped 300.7 to 44; the die's own cast saturates (and rounds half to even)."""
    info = np.iinfo(dtype)
    x = np.array([300.7, -300.2, np.nan, 2.5, 3.5, -2.5, 1e30, -1e30, np.inf, -np.inf, 0.49])
    pod = Pod(cloudmatrix384(dies=1))
    got = pod.to_gm(0, x, dtype=dtype).numpy()
    expect = [min(301, info.max), max(-300, info.min), 0, 2, 4, max(-2, info.min), info.max, info.min, info.max,
              info.min, 0]
    assert got.tolist() == expect
    ints = np.array([300, -300, 2 ** 40, -2 ** 40, 7], np.int64)
    got = pod.to_gm(0, ints, dtype=dtype).numpy()
    assert got.tolist() == np.clip(ints, info.min, info.max).tolist()


def test_to_gm_refuses_non_numeric_data_and_host_writes_check_shapes():
    pod = Pod(cloudmatrix384(dies=1))
    with pytest.raises(DTypeError, match="not numeric"):
        pod.to_gm(0, np.array(["a", "b"]))
    with pytest.raises(DTypeError, match="not numeric"):
        pod.to_gm(0, np.array([1 + 2j]))
    t = pod.alloc(0, (4,), "fp32")
    with pytest.raises(ShapeError, match="shape"):
        t.write(np.ones(3))
    with pytest.raises(ShapeError, match="shape"):
        pod.host_write(t, np.ones((2, 4)))
    with pytest.raises(ArgumentError, match="at_us"):
        pod.host_write(t, 1.0, at_us=-1.0)
