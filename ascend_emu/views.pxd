cdef class Store:
    cdef public object name, data, space, die, core, uid
    cdef public long long nbytes, base
    cdef public object regions, lent
    cdef public object shadow, deferred

cdef class View:
    cdef public Store store
    cdef public long long offset, lo, hi
    cdef public tuple shape, strides
    cdef public object dtype, _arr
    cdef public tuple _blk, _l2fp
    cdef public dict _kids
    cdef object __weakref__
    cpdef tuple _layout(self)
