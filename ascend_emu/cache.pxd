cimport cython

cdef unsigned long long _FULL, _M1, _M2, _M4, _H01
cdef Py_ssize_t PAGE_LINES

cpdef unsigned long long popcount(unsigned long long x)

cdef long long _SLOTS0
cdef unsigned long long _GOLDEN

cdef class L2:
    cdef public object die
    cdef public long long line_bytes, capacity_lines, resident, dirty, hit, miss, evicted
    cdef public long long read_hit, read_miss, write_lines, writeback, n_pages
    cdef long long _free, _tmask, _shift
    cdef long long[::1] _key, _prev, _next, _table
    cdef unsigned long long[::1] _valid, _dirty
    cdef _clear(self, long long slots)
    @cython.locals(mask=cython.ulonglong, new=cython.ulonglong, hit=cython.longlong, miss=cython.longlong,
                   evicted=cython.longlong, dirty=cython.longlong, i=Py_ssize_t, n_new=cython.longlong,
                   key=cython.longlong, s=cython.longlong)
    cpdef access(self, tuple fp, bint write)
    cdef unsigned long long _home(self, long long key)
    @cython.locals(h=cython.longlong, s=cython.longlong)
    cdef long long _slot(self, long long key)
    @cython.locals(h=cython.longlong, s=cython.longlong)
    cdef Py_ssize_t _insert(self, long long key) except -1
    @cython.locals(last=cython.longlong)
    cdef void _link_last(self, long long s, bint linked)
    @cython.locals(i=cython.longlong, j=cython.longlong, t=cython.longlong, k=cython.longlong)
    cdef _drop(self, long long s)
    cdef _grow(self)
    @cython.locals(s=cython.longlong, out=list)
    cpdef list pages(self)
    @cython.locals(slots=cython.longlong)
    cpdef load(self, list pages)
    @cython.locals(s=cython.longlong)
    cdef _refill(self, list pages, long long slots)
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
