cimport cython

cdef extern from "Python.h":
    Py_ssize_t PyLong_AsSsize_t(object o)     # no exception check: -1 and an error set past a C integer
    void PyErr_Clear()

cdef bint _COMPILED
cdef class Store:
    cdef public object name, data, space, die, core, uid
    cdef public long long nbytes, base
    cdef public object regions, lent, loads
    cdef public object shadow, deferred

cdef class View:
    cdef public Store store
    cdef public long long offset, lo, hi
    cdef public tuple shape, strides
    cdef public object dtype, _arr
    cdef public tuple _blk, _l2fp
    cdef public dict _kids
    cdef public list _ints
    cdef object __weakref__
    cpdef tuple _layout(self)
    @cython.locals(i=Py_ssize_t, ints=list)
    cdef _int_kid(self, key)
    @cython.locals(offset=cython.longlong, lo=cython.longlong, hi=cython.longlong, n=cython.longlong,
                   s=cython.longlong, step=cython.longlong, start=cython.longlong, stop=cython.longlong,
                   m=cython.longlong, i=cython.longlong, dim=Py_ssize_t, empty=bint, shape=list, strides=list)
    cpdef _cut(self, key)
    cpdef _slice(self, key)
