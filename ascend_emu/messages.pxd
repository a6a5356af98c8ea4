cimport cython
from .isa cimport Instr
from .staging cimport Pull, Push, Reply
from .views cimport View

# the staged transfers' flat batches: typed loops over the records (the codec's cost is Python per message)
cdef class _Flat:
    cdef public list ints, objs, vints, table
    cdef public dict index
    cpdef object key(self, tuple key)
    @cython.locals(v=View, vints=list, index=dict, table=list, lay=tuple)
    cpdef views(self, tuple views)
    @cython.locals(held=tuple, key=tuple, dsts=tuple, n=Py_ssize_t, cid=tuple)
    cpdef tuple handle(self, codec, Instr ins)
    @cython.locals(ints=list, vints=list)
    cpdef tuple data(self)

@cython.locals(n=Py_ssize_t, m=Py_ssize_t)
cpdef tuple _records(tuple data, str name)
@cython.locals(stores=dict, out=list, i=Py_ssize_t)
cpdef tuple _views_of(codec, views, list table, Py_ssize_t n)
@cython.locals(home=cython.longlong, n=cython.longlong, ins=Instr)
cpdef Instr _handle_of(codec, tuple h, spec, origin, hb, views, list table)
@cython.locals(out=_Flat, ints=list, objs=list, m=Pull, h=tuple, ho=tuple)
cpdef tuple _encode_pulls(codec, list batch)
@cython.locals(i=tuple, o=tuple, src=View, ins=Instr, table=list)
cpdef _decode_pulls(codec, tuple data, list heap)
@cython.locals(out=_Flat, ints=list, objs=list, m=Push, h=tuple, ho=tuple, n=Py_ssize_t)
cpdef tuple _encode_pushes(codec, list batch)
@cython.locals(i=tuple, o=tuple, ins=Instr, table=list, n=cython.longlong, dsts=tuple)
cpdef _decode_pushes(codec, tuple data, list heap)
@cython.locals(out=_Flat, ints=list, objs=list, m=Reply, h=tuple, ho=tuple)
cpdef tuple _encode_replies(codec, list batch)
@cython.locals(i=tuple, o=tuple, ins=Instr, table=list)
cpdef _decode_replies(codec, tuple data, list heap)
