cimport cython
from .isa cimport Instr, OpSpec, cost_vector
from .timing cimport Server, Route, Traffic
from .cache cimport L2
from .views cimport View, Store
from .tracker cimport Regions
from .origin cimport Issuer, origin_at, origin_of
from .polls cimport Polls

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(object op)
    int PyObject_GC_IsTracked(object op)

# module constants as C values (the .py assigns them; compiled code reads them without a dict lookup)
cdef int _EV_RESUME, _EV_RESERVE, _EV_SYNC, _EV_COMMIT, _EV_RESUME_AFTER, _EV_EXECUTE, COMPUTE, TRANSFER, SYNC
cdef OpSpec _KERNEL_END, _PIPE_BARRIER, _BARRIER, _LOAD, _FIXPIPE, _FIXPIPE_L1
cdef object _PIPE_END, _HOST, _LENT, _GENERATOR, _COST_VECTOR
cdef bint _COMPILED

@cython.final
cdef class _Last:
    cdef public Instr ins

@cython.final
cdef class _Busy:
    cdef public long long ps

cdef class Event

cdef class Core:
    cdef public object die, kind, idx, unit, launch, ctx, gen, drain, resume_value, blocked_on
    cdef public long long time, max_end, block_start
    cdef public dict pipe_last, gm_regs, xflags, _busy
    cdef public Py_ssize_t unscheduled
    cdef public bint done, killed
    cdef public Traffic traffic
    cdef public Issuer issuer
    @cython.locals(b=_Busy)
    cpdef _charge(self, object pipe, long long dur)

@cython.final
cdef class Engine:
    cdef dict __dict__
    cdef public object prof, paths, trace, horizon_ps, on_core_done, progress, _flows, sanitizer, jitter, remote, staging, part
    cdef public long long l2_lat, hbm_lat, home, host_after, now, issue_ps, last_activity, n_instr, bytes_moved, run_start, line_bytes, n_lent, origin, event_count
    cdef public set lent_stores
    cdef public set dma_active
    cdef public dict dma_queue
    cdef public list heap, timers, cores, _counts
    cdef public dict busy
    cdef public Polls polls
    cdef public set dead_dies
    @cython.locals(horizon=cython.longlong, tick=cython.longlong, ev=Event)
    cpdef run(self, long long until=*)
    cpdef push(self, long long t, object fn, object arg)
    cpdef send(self, long long t, long long die, object fn, object arg)
    cpdef long long _count(self, long long origin)
    cdef _slice(self, object die, object unit, object track, object name, long long start, long long end, object args)
    @cython.locals(instr=Instr)
    cpdef _resume(self, Core core)
    @cython.locals(spec=OpSpec, last=Instr, ws=list, pipe_last=dict, kind=int, real=bint, v=View, iss=Issuer,
                   cell=_Last)
    cpdef issue(self, Core core, Instr ins)
    @cython.locals(prev=Instr, end=cython.longlong)
    cpdef _close_pipe(self, Instr ins)
    @cython.locals(core=Core, d=Instr)
    cpdef _scheduled(self, Instr ins)
    @cython.locals(ws=list, v=cython.longlong)
    cdef _dep(self, Instr ins, Instr other, object which)
    @cython.locals(st=Store, regs=Regions, blk=tuple)
    cdef _track(self, Core core, Instr ins, View v, bint write)
    cpdef _ready(self, Instr ins)
    @cython.locals(start=cython.longlong, dur=cython.longlong, lat=cython.longlong, spec=OpSpec, core=Core, cost=object)
    cpdef _schedule_compute(self, Instr ins)
    @cython.locals(x=Instr, w=Instr, stack=list, ws=list, k=int, i=Py_ssize_t, end=cython.longlong,
                   busy_end=cython.longlong, pipe_end=cython.longlong, v=cython.longlong, which=object)
    cpdef _release(self, Instr ins)
    @cython.locals(spec=OpSpec, core=Core, r=Route, eng=Server, c=L2, tr=Traffic, gm_bytes=cython.longlong, hbm_lines=cython.longlong, nbytes=cython.longlong, start=cython.longlong,
                   flow=cython.longlong, finish=cython.longlong, mover=cython.double, mover_ps=cython.longlong, lat=cython.longlong,
                   line=cython.longlong, lines=cython.longlong, miss_b=cython.longlong, i=Py_ssize_t, links=tuple)
    cpdef _reserve(self, Instr ins)
    @cython.locals(spec=OpSpec, core=Core, r=Route, eng=Server, nbytes=cython.longlong, start=cython.longlong,
                   finish=cython.longlong, dur=cython.longlong)
    cpdef _occupy(self, Instr ins, long long flow)
    cdef tuple _footprint(self, View view, Instr ins)
    @cython.locals(spec=OpSpec, st=Store, v=View, src=View, loan=View)
    cpdef _execute(self, Instr ins)
    @cython.locals(v=View, spec=OpSpec)
    cpdef _settle_srcs(self, Instr ins)
    @cython.locals(st=Store)
    cpdef _lend(self, Instr ins, View loan)
    @cython.locals(lo=cython.longlong, hi=cython.longlong, x=Instr, d=View, s=View, rem=cython.longlong,
                   i=cython.longlong, k=Py_ssize_t, idx=list, st=Store)
    cpdef _stand_in(self, View u)
    @cython.locals(st=Store, loads=set, lo=cython.longlong, hi=cython.longlong, x=Instr)
    cpdef _settle_reads(self, View v)
    @cython.locals(st=Store, loads=set, lo=cython.longlong, hi=cython.longlong, whole=bint, x=Instr, d=View)
    cpdef _drop_covered(self, View v)
    @cython.locals(st=Store, lent=set, loads=set, hit=list, lo=cython.longlong, hi=cython.longlong, x=Instr)
    cpdef _unlend_overlapping(self, View v)
    @cython.locals(st=Store)
    cpdef _unlend(self, Instr ins)
    @cython.locals(st=Store, x=Instr)
    cpdef _settle_all(self)

@cython.final
@cython.freelist(64)
cdef class Event:
    cdef public long long t, origin, count, die
    cdef public object fn, arg

@cython.locals(e=Event)
cdef Event _event(long long t, long long origin, long long count, long long die, object fn, object arg)
cpdef queue(list heap, long long t, long long origin, long long count, long long die, object fn, object arg)
cdef long long _time_of(Event e)
cdef bint _before(Event a, Event b)
cdef _heap_push(list heap, Event item)
@cython.locals(last=Event, first=Event, end=Py_ssize_t, pos=Py_ssize_t, child=Py_ssize_t, right=Py_ssize_t)
cdef Event _heap_pop(list heap)
@cython.locals(parent=Py_ssize_t, up=Event)
cdef _sift_down(list heap, Py_ssize_t pos, Event item)

@cython.locals(occ=cython.longlong, t=cython.longlong)
cpdef long long _book(Server s, long long nbytes, long long flow, long long finish)

@cython.locals(x=object)
cdef tuple _untracked(tuple record)
cdef tuple _untracked_but(tuple record, object x)
@cython.locals(p=dict)
cpdef bint _lends(Instr ins) except -1
