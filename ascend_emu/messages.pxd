cimport cython
from .engine cimport queue
from .isa cimport Instr, new_instr
from .staging cimport Pull, Push, Reply
from .views cimport View

# the staged transfers' flat batches: typed loops over the records (the codec's cost is Python per message), their
# ints written and read through typed buffers
cdef class _Flat:
    cdef public object ints, vints
    cdef long long[::1] iv, vv
    cdef public Py_ssize_t n, nv
    cdef public list objs, table
    cdef public dict index, handles, waiting, core_ids
    cdef public object codec, peer, rank
    cdef void put(self, long long x)
    @cython.locals(iv="long long[::1]", n=Py_ssize_t)
    cdef void message(self, long long t, long long origin, long long count, long long die)
    cdef void transfer(self, tuple key, long long nbytes, long long flow, long long finish)
    cpdef object key(self, tuple key)
    @cython.locals(v=View, index=dict, table=list, lay=tuple, shape=tuple, k=Py_ssize_t, vv="long long[::1]")
    cpdef views(self, tuple views)
    @cython.locals(held=tuple, key=tuple, dsts=tuple, n=Py_ssize_t, cid=tuple)
    cpdef tuple handle(self, Instr ins)
    cpdef tuple data(self)

cdef class _Read:
    cdef long long[::1] iv, vv
    cdef public Py_ssize_t n, nv
    cdef public list objs, table, launches
    cdef public dict stores, waiting, handles
    cdef public object rank
    cdef long long get(self)
    @cython.locals(stores=dict, table=list, out=list, k=Py_ssize_t, vv="long long[::1]")
    cpdef tuple views_of(self, Py_ssize_t n)
    @cython.locals(home=cython.longlong, rank=cython.longlong, ident=cython.longlong, li=Py_ssize_t,
                   ci=Py_ssize_t, busy_end=cython.longlong, start=cython.longlong, n=cython.longlong, ins=Instr)
    cpdef Instr handle(self, spec, origin, hb)

@cython.locals(out=_Flat, objs=list, m=Pull, ho=tuple)
cpdef tuple _encode_pulls(codec, list batch)
@cython.locals(rd=_Read, objs=list, r=Py_ssize_t, t=cython.longlong, origin=cython.longlong, count=cython.longlong,
               die=cython.longlong, key=Py_ssize_t, nbytes=cython.longlong, flow=cython.longlong,
               finish=cython.longlong, real=bint, src=View, ins=Instr)
cpdef _decode_pulls(codec, tuple data, list heap)
@cython.locals(out=_Flat, objs=list, m=Push, ho=tuple, at=Py_ssize_t)
cpdef tuple _encode_pushes(codec, list batch)
@cython.locals(rd=_Read, objs=list, r=Py_ssize_t, t=cython.longlong, origin=cython.longlong, count=cython.longlong,
               die=cython.longlong, key=Py_ssize_t, nbytes=cython.longlong, flow=cython.longlong,
               finish=cython.longlong, lat=cython.longlong, real=bint, l2=cython.longlong, hbm=cython.longlong,
               n=cython.longlong, ins=Instr, dsts=tuple)
cpdef _decode_pushes(codec, tuple data, list heap)
@cython.locals(out=_Flat, objs=list, m=Reply, ho=tuple)
cpdef tuple _encode_replies(codec, list batch)
@cython.locals(rd=_Read, objs=list, r=Py_ssize_t, t=cython.longlong, origin=cython.longlong, count=cython.longlong,
               die=cython.longlong, end=cython.longlong, l2=cython.longlong, hbm=cython.longlong, ins=Instr)
cpdef _decode_replies(codec, tuple data, list heap)
