cimport cython
from .isa cimport Instr, OpSpec

cdef extern from "Python.h":
    ctypedef struct PyObject
    int PyList_SetSlice(object lst, Py_ssize_t low, Py_ssize_t high, PyObject *items) except -1

cdef bint _COMPILED
cdef OpSpec _GM_STORE
cdef Py_ssize_t WIDE, SCAN, PRUNE_AT

cdef class Region:
    cdef public long long lo, hi, read_end
    cdef public object pattern
    cdef public Instr writer
    cdef public list readers
    @cython.locals(w=Instr, rd=Instr)
    cpdef bint live(self, long long t)

cdef class Regions:
    cdef public list narrow, starts, wide
    cdef public Py_ssize_t prune_at
    cdef public long long span
    @cython.locals(narrow=list, starts=list, wide=list, n=Py_ssize_t, i0=Py_ssize_t, i1=Py_ssize_t, i=Py_ssize_t,
                   n_narrow=Py_ssize_t, n_cands=Py_ssize_t,
                   ready=cython.longlong, e=cython.longlong, covered=Py_ssize_t, posted=bint, use_end=bint,
                   r=Region, hit=Region, w=Instr, rd=Instr, ws=list, rs=list)
    cpdef track(self, Instr ins, long long lo, long long hi, object pattern, bint write, long long now, object san=*)
    cdef _add(self, Region r)
    @cython.locals(starts=list, i0=Py_ssize_t, i1=Py_ssize_t, keep=list, r=Region)
    cdef _drop_within(self, long long lo, long long hi)
    @cython.locals(r=Region, left=Py_ssize_t)
    cpdef prune(self, long long t)

@cython.locals(step=cython.longlong, d=cython.longlong)
cdef bint _collide(long long a0, tuple pa, long long b0, tuple pb)
