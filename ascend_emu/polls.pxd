cimport cython

cdef Py_ssize_t _GRAIN, _SPAN

cpdef object poll_key(ins)
@cython.locals(b0=cython.longlong, b1=cython.longlong)
cdef object _blocks(v)

cdef class _Group:
    cdef public object view, blocks
    cdef public list waiting

cdef class _StorePolls:
    cdef public dict groups, index, wide

cdef class Polls:
    cdef public dict stores
    cdef public long long order
    @cython.locals(sp=_StorePolls, g=_Group, index=dict, keys=dict)
    cpdef add(self, ins)
    @cython.locals(sp=_StorePolls, g=_Group, b0=cython.longlong, b1=cython.longlong, index=dict, groups=dict,
                   cands=list, hit=list, done=list, keys=dict)
    cpdef landed(self, uid, long long lo, long long hi, check)
    @cython.locals(sp=_StorePolls, g=_Group, n=Py_ssize_t)
    cpdef bint remove(self, ins) except -1
    cpdef drop(self, gone)

@cython.locals(g=_Group)
cdef object _key_of(_StorePolls sp, ins)
@cython.locals(g=_Group, index=dict, keys=dict)
cdef _Group _drop_group(_StorePolls sp, key)
