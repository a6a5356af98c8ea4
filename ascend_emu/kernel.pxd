cimport cython
from .views cimport View, Store
from .isa cimport Instr, OpSpec, new_instr

cdef OpSpec _COPY_GM_TO_UB, _COPY_GM_TO_L1, _COPY_UB_TO_GM, _COPY_UB_TO_GM_ADD
cdef OpSpec _V_ADD, _V_SUB, _V_MUL, _V_DIV, _V_MAX, _V_MIN, _V_ADDS, _V_MULS, _V_MAXS, _V_MINS
cdef OpSpec _V_DIVS, _V_EXP, _V_LN, _V_SQRT, _V_RSQRT, _V_ABS, _V_RELU, _V_NEG, _V_RECIPROCAL, _V_VCOPY

@cython.final
cdef class KernelContext:
    cdef dict __dict__
    cdef public object _engine, _core, _paths, profile, die, rank, num_ranks, core_kind, core_idx, block_idx
    cdef public object block_num, group_idx, sub_block_idx, args, _owner, _timeout_ps, vec
    cdef public object _ub, _l1, _l0a, _l0b, _l0c, _bt, _fb
    cdef public bint is_aiv, is_aic
    cdef public dict _align_of, _routes
    cdef public object _rd_mover, _rd_route, _wr_mover, _wr_route
    cdef public long long _rd_die, _wr_die
    cdef public Py_ssize_t _last_align
    cdef public object _last_space
    cdef public long long _burst_bytes
    @cython.locals(st=Store, tile=View, align=cython.longlong)
    cpdef _local(self, v, tuple spaces, arg, bint aligned=*)
    cdef Py_ssize_t _space_align(self, space) except? -1
    cpdef _gm(self, v, arg)
    @cython.locals(local=View, gm=View, align=cython.longlong, burst=cython.longlong, block=cython.longlong, g=tuple,
                   blk=tuple, lblock=cython.longlong, count=cython.longlong)
    cpdef Py_ssize_t _align(self, local, gm, bint pad, what) except? -1
    @cython.locals(ins=Instr, die=cython.longlong)
    cpdef Instr _xfer(self, OpSpec spec, mover, dst, src, src_die, dst_die, long long nbytes, p=*)
    @cython.locals(by_die=dict)
    cpdef _route(self, mover, src_die, dst_die, long long die)

@cython.final
cdef class Vector:
    cdef public KernelContext _ctx
    @cython.locals(ctx=KernelContext, d=View, v=View, i=Py_ssize_t)
    cpdef Instr _op(self, OpSpec spec, dst, tuple srcs, p=*, bint arith=*)
    @cython.locals(d=View)
    cpdef Instr _scalar_op(self, OpSpec spec, dst, a, scalar)

cdef object _die(View v)
cdef _same(View dst, View src, what, bint check_dtype=*)
cdef bint _broadcastable(tuple src, tuple dst) except -1
