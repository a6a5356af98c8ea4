cimport cython
from .views cimport View
cdef class OpSpec:
    cdef public object name, pipe, execute, commit, cost
    cdef public int kind, row
    cdef public double cpr
    cdef public bint gm_rows, lends

@cython.freelist(256)
cdef class Instr:
    cdef public OpSpec spec
    cdef public tuple dsts, srcs
    cdef public object p, core, result, path, hb, origin, loan
    cdef public Instr pipe_prev
    cdef public long long ready, nbytes, dur, lat, start, busy_end, end, pipe_end
    cdef public Py_ssize_t pending
    cdef public list waiters
    cdef public bint blocking, real

cpdef Instr new_instr(OpSpec spec, tuple dsts, tuple srcs, p=*, bint blocking=*)
cdef void _fill(Instr ins, OpSpec spec, tuple dsts, tuple srcs, object p, bint blocking)

cdef list _VECTOR_PS
cdef Py_ssize_t _VECTOR_MEMO_MAX, _ROWS_MAX
@cython.locals(memo=dict)
cpdef dict _memo(prof)
@cython.locals(nbytes=cython.longlong, align=cython.longlong, n=cython.longlong, memo=dict, spec=OpSpec,
               key=cython.longlong)
cpdef tuple cost_vector(Instr ins, prof)
@cython.locals(blk=tuple, count=cython.longlong, block=cython.longlong)
cdef long long _aligned_blocks_bytes(View v, long long align) except? -1
