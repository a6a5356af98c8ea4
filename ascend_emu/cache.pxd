cimport cython

cdef unsigned long long _FULL, _M1, _M2, _M4, _H01
cdef Py_ssize_t PAGE_LINES

cpdef unsigned long long popcount(unsigned long long x)

cdef class Page:
    cdef public unsigned long long valid, dirty

cdef class L2:
    cdef public object die, pages, _get, _to_end
    cdef public long long line_bytes, capacity_lines, resident, dirty, hit, miss, evicted
    cdef public long long read_hit, read_miss, write_lines, writeback, _mru
    @cython.locals(pg=Page, mask=cython.ulonglong, new=cython.ulonglong, hit=cython.longlong, miss=cython.longlong,
                   evicted=cython.longlong, dirty=cython.longlong, i=Py_ssize_t, old=Page, n_new=cython.longlong,
                   key=cython.longlong)
    cpdef access(self, tuple fp, bint write)
    cpdef invalidate(self)

cdef class Caches:
    cdef public long long capacity, line_bytes
    cdef public dict by_die
    cpdef L2 of(self, die)
    cpdef dict take_stats(self)
    cpdef invalidate(self)

cdef Py_ssize_t LOOP_BLOCKS
@cython.locals(base=cython.longlong, lo=cython.longlong, top=cython.longlong, hi=cython.longlong,
               width=cython.longlong, one=cython.ulonglong)
cdef unsigned long long _page_mask(long long first, long long last, long long page)
@cython.locals(first=cython.longlong, last=cython.longlong, page=cython.longlong, out=list)
cpdef tuple _range_footprint(long long a, long long b, long long line_bytes)
cdef dict _PATTERN_MEMO
cdef Py_ssize_t PATTERN_MEMO_MAX
@cython.locals(page_bytes=cython.longlong, first=cython.longlong, rel=cython.longlong, i=Py_ssize_t, out=list,
               fp=tuple)
cpdef tuple _pattern_footprint(long long a, long long count, long long step, long long block, long long line_bytes)
@cython.locals(out=list, cur_page=cython.longlong, cur_mask=cython.ulonglong, j=Py_ssize_t, s=cython.longlong,
               first=cython.longlong, last=cython.longlong, page=cython.longlong, mask=cython.ulonglong)
cpdef tuple _sorted_blocks_footprint(object starts, long long block, long long line_bytes)
