cimport cython
from .isa cimport Instr, new_instr
from .staging cimport Pull, Push, Reply
from .views cimport View

# the staged transfers' flat batches: typed loops over the records (the codec's cost is Python per message)
cdef class _Flat:
    cdef public list ints, objs, vints, table
    cdef public dict index, handles, waiting, core_ids
    cdef public object codec, peer, rank
    cpdef object key(self, tuple key)
    @cython.locals(v=View, vints=list, index=dict, table=list, lay=tuple, shape=tuple)
    cpdef views(self, tuple views)
    @cython.locals(held=tuple, key=tuple, dsts=tuple, n=Py_ssize_t, cid=tuple)
    cpdef tuple handle(self, Instr ins)
    @cython.locals(ints=list, vints=list)
    cpdef tuple data(self)

cdef class _Read:
    cdef public object records, views
    cdef public list table, launches
    cdef public dict stores, waiting, handles
    cdef public object rank
    @cython.locals(stores=dict, table=list, out=list)
    cpdef tuple views_of(self, Py_ssize_t n)
    @cython.locals(home=cython.longlong, n=cython.longlong, ins=Instr)
    cpdef Instr handle(self, tuple h, spec, origin, hb)

@cython.locals(out=_Flat, ints=list, objs=list, m=Pull, h=tuple, ho=tuple)
cpdef tuple _encode_pulls(codec, list batch)
@cython.locals(rd=_Read, i=tuple, o=tuple, src=View, ins=Instr)
cpdef _decode_pulls(codec, tuple data, list heap)
@cython.locals(out=_Flat, ints=list, objs=list, m=Push, h=tuple, ho=tuple, n=Py_ssize_t)
cpdef tuple _encode_pushes(codec, list batch)
@cython.locals(rd=_Read, i=tuple, o=tuple, ins=Instr, n=cython.longlong, dsts=tuple)
cpdef _decode_pushes(codec, tuple data, list heap)
@cython.locals(out=_Flat, ints=list, objs=list, m=Reply, h=tuple, ho=tuple)
cpdef tuple _encode_replies(codec, list batch)
@cython.locals(rd=_Read, i=tuple, o=tuple, ins=Instr)
cpdef _decode_replies(codec, tuple data, list heap)
