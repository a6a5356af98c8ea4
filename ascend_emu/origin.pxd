cimport cython

@cython.locals(by_site=dict)
cpdef dict origin_of(dict sites, object gen, object kernel)

@cython.locals(code_id=cython.longlong, at=cython.longlong)
cdef object _site_key(object frame)

cdef dict _DELEGATES
cdef bint _COMPILED

cdef extern from *:
    """
    #define __pyx_origin_frame_lasti(f) PyFrame_GetLasti((PyFrameObject *)(f))
    """
    int _frame_lasti "__pyx_origin_frame_lasti" (object frame)

cdef int _lasti(object frame) except? -2

cdef Py_ssize_t _WAYS

cdef class Issuer:
    cdef public object gen, frame, kernel
    cdef public long long base
    cdef public dict by_site, by_at, sites
    cdef public list ats, args
    @cython.locals(way=Py_ssize_t)
    cpdef _know(self, long long at, object o)

@cython.locals(code_id=cython.longlong, at=cython.longlong, site=tuple, way=Py_ssize_t, known=cython.longlong)
cpdef dict origin_at(Issuer issuer, dict sites, object gen, object kernel)
