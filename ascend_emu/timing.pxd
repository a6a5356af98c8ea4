from .cache cimport L2

cdef class Server:
    cdef public object name, die, log
    cdef public double bw
    cdef public long long free, busy_ps, bytes

cdef class Traffic:
    cdef public long long l2_bytes, hbm_bytes, fabric_bytes

cdef class Route:
    cdef public L2 read_cache, write_cache
    cdef public Server read_l2, read_hbm, write_l2, write_hbm, engine
    cdef public tuple links
    cdef public long long link_lat, startup
    cdef public double rate_hit, rate_miss, rate_write, remote_rate
    cdef public int stage
    cdef public tuple send_links, recv_links, key
    cdef public long long hop_out, hop_back
