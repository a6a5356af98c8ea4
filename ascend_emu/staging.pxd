cimport cython
from .isa cimport Instr, OpSpec
from .timing cimport Server, Route, Traffic
from .cache cimport L2
from .views cimport View

# the messages (plain classes with __slots__ in the sources; extension types with C fields here)
cdef class Pull:
    cdef public tuple key
    cdef public object src, rows, issuer_die, to_die, handle
    cdef public long long nbytes, flow, finish
    cdef public bint real

cdef class Push:
    cdef public tuple key, dsts
    cdef public object result, commit, rows, issuer_die, handle
    cdef public long long nbytes, flow, finish, lat, l2_bytes, hbm_bytes
    cdef public bint real

cdef class Reply:
    cdef public long long end, l2_bytes, hbm_bytes
    cdef public object data, handle

cdef class Staging:
    cdef public object engine, paths, book, lends, lent
    cdef public long long line
    cdef public dict _closing
    @cython.locals(r=Route, spec=OpSpec, stage=int, nbytes=cython.longlong, start=cython.longlong,
                   flow=cython.longlong, finish=cython.longlong, l2_bytes=cython.longlong,
                   hbm_bytes=cython.longlong, lat=cython.longlong, mover=cython.double, hop=cython.longlong,
                   tr=Traffic, src=View)
    cpdef start(self, Instr ins)
    @cython.locals(ws=list, early=list, late=list, i=Py_ssize_t, proxy=Instr)
    cpdef _release_pipe(self, Instr ins)
    @cython.locals(r=Route, here=object, finish=cython.longlong, l2_bytes=cython.longlong,
                   hbm_bytes=cython.longlong, lat=cython.longlong, hop=cython.longlong, end=cython.longlong,
                   ins=Instr)
    cpdef _pulled(self, Pull m)
    @cython.locals(r=Route, finish=cython.longlong, l2_bytes=cython.longlong, hbm_bytes=cython.longlong,
                   land=cython.longlong, back=cython.longlong)
    cpdef _pushed(self, Push m)
    @cython.locals(v=View)
    cpdef _land(self, Push m)
    @cython.locals(ins=Instr, tr=Traffic, dst=View)
    cpdef _replied(self, Reply m)
    cpdef _take(self, Instr ins)
    cpdef _drop(self, Push m)
    cpdef abandon(self)
    cpdef close_after(self, prev, ins)
    cpdef _closed(self, ins)
    cpdef long long _end(self, ins, long long finish, long long lat)
    @cython.locals(v=View)
    cpdef tuple _fp(self, view, ins, rows=*)
    @cython.locals(moved=cython.longlong)
    cpdef tuple _memory(self, L2 cache, Server l2, Server hbm, tuple fp, bint write, long long nbytes, long long flow,
                        long long finish)
