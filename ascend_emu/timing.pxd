cdef class Server:
    cdef public object name
    cdef public double bw
    cdef public long long free, busy_ps, bytes
