"""The timing model: shared-bandwidth servers, the route a copy takes, and the cost of each instruction class.

Time is integer picoseconds. Every constant comes from the ``HardwareProfile``; nothing here is tuned to a result.

Shared resources are first-come-first-served servers with a bandwidth: each die's L2 and HBM, each die's fabric send
and receive ports, the die-to-die link of a chip, each DMA engine. Every GM access goes through the L2 of the die
that owns the memory (cache.py): all its bytes pass that L2's server, the lines it misses and the dirty lines it
evicts also pass the HBM server. A transfer is timed when it becomes ready, in simulated-time order: its mover (MTE2,
MTE3, FIXP of its core, or a DMA engine) moves the bytes at the per-core rate of where they come from and go to
(the platform file's ``[AICoreMemoryRates]``: L2 hits at ``l2_read_rate``, misses at ``ddr_read_rate``, writes into the
L2 at ``ub_to_l2_rate`` / ``l2_write_rate``), and a core reaching into another die keeps at most
``remote_outstanding_bytes`` in flight per round trip. Each server on the route takes the bytes once it is free, at
its bandwidth; the pipe is busy until the mover and every server have passed them, and the data is visible one
route latency later. Many cores therefore overlap their copies until a shared server saturates, and contention
between cores and dies shows up in modeled time.

modeled as: each server serves whole transfers in arrival order (no interleaving of two transfers' bytes); the
aggregate bandwidth is right, the completion order among simultaneous transfers is FIFO rather than fair-share, and a
server's queue never holds back another server (a transfer is a fluid stream, not a store-and-forward packet).
"""
from __future__ import annotations

from .cache import Caches
from .profile import HardwareProfile


class Server:
    """A shared bandwidth resource (bytes per picosecond) of die ``die`` (a chip-pair link: the sending chip's first
    die). ``log``: None, or (tracing on) the list of ``(start_ps, end_ps, bytes)`` it served this run, for the
    trace's bandwidth counters."""

    __slots__ = ("name", "bw", "free", "busy_ps", "bytes", "die", "log")

    def __init__(self, name: str, gbps: float, die: int = 0, log: list | None = None):
        self.name = name
        self.bw = gbps / 1000.0   # GB/s -> bytes/ps
        self.free = 0
        self.busy_ps = 0
        self.bytes = 0
        self.die = die
        self.log = log


class Traffic:
    """GM traffic caused by one launch's transfers (bytes, summed over its dies and cores): ``l2_bytes`` every byte
    read from or written to GM (each passes the owning die's L2), ``hbm_bytes`` what those accesses made the HBMs
    move (lines missed, dirty lines they evicted written back), ``fabric_bytes`` bytes that crossed dies.
    modeled as: an eviction is charged to the launch whose access caused it, as the L2 does its write-back then."""

    __slots__ = ("l2_bytes", "hbm_bytes", "fabric_bytes")

    def __init__(self):
        self.l2_bytes = self.hbm_bytes = self.fabric_bytes = 0

    def to_dict(self) -> dict:
        return {"l2_bytes": self.l2_bytes, "hbm_bytes": self.hbm_bytes, "fabric_bytes": self.fabric_bytes}


# Route.stage: where a transfer's GM operands live relative to its mover's die (staging.py)
LOCAL = 0       # every GM operand on the mover's die: timed at once, at its start (Engine._reserve)
WRITE = 1       # bytes leave the mover's die for GM on another die (MTE3, FIXP, a DMA from its own die's GM)
READ = 2        # bytes come from GM on another die to the mover's die (MTE2, a DMA into its own die's GM)
RELAY = 3       # a DMA between GM on other dies than its own: request to the source, data on to the destination


class Route:
    """The fixed part of a transfer's path, resolved once per (mover, core die, source die, destination die).

    ``read_*``: the L2 cache and the L2 / HBM servers of the die a GM source lives on (None: no GM source);
    ``write_*`` likewise for a GM destination. ``links``: fabric servers between the dies. Rates are bytes per ps
    of the core's mover: ``rate_hit`` / ``rate_miss`` for read bytes that hit / miss the L2, ``rate_write`` for
    bytes written into GM; ``remote_rate`` (> 0 across dies) caps the mover at outstanding bytes per round trip.
    ``engine``: the DMA engine server (None for the cores' movers), whose own bandwidth is the mover's.

    Across dies (``stage`` != LOCAL) the transfer is staged over the dies it involves (staging.py): ``send_links``
    are the fabric servers of the die the bytes leave (its send port, a pair link), ``recv_links`` the receive port
    of the die they reach; ``hop_out`` is the latency from the mover's die to the first other die the transfer
    involves, ``hop_back`` from the last one back to the mover's die; ``key`` is the ``Paths.path`` arguments, so a
    die receiving a message resolves the same route among its own servers.
    """

    __slots__ = ("read_cache", "read_l2", "read_hbm", "write_cache", "write_l2", "write_hbm", "links", "link_lat",
                 "startup", "engine", "rate_hit", "rate_miss", "rate_write", "remote_rate", "stage", "send_links",
                 "recv_links", "hop_out", "hop_back", "key")

    def __init__(self):
        self.read_cache = self.read_l2 = self.read_hbm = None
        self.write_cache = self.write_l2 = self.write_hbm = None
        self.links = ()
        self.link_lat = 0
        self.startup = 0
        self.engine = None
        self.rate_hit = self.rate_miss = self.rate_write = 0.0
        self.remote_rate = 0.0
        self.stage = LOCAL
        self.send_links = self.recv_links = ()
        self.hop_out = self.hop_back = 0
        self.key = ()


class Paths:
    """Resolves the route, servers and latencies of transfers; owns the shared servers and the dies' L2 caches."""

    def __init__(self, prof: HardwareProfile):
        self.prof = prof
        self.servers: dict[str, Server] = {}
        self.log_usage = False      # servers log what they serve (set by a traced pod; untraced runs pay nothing)
        self.caches = Caches(prof.l2_bytes, prof.l2_line_bytes)
        self._cache: dict = {}
        self._scalar: dict = {}       # (core die, GM die, round trip) -> scalar_lat (one per flag store or poll)
        ps = 1000.0
        self.hbm_lat = int(prof.gm_latency_ns * ps)      # load-to-use of a GM access that misses the L2
        self.l2_lat = int(prof.l2_latency_ns * ps)       # ... that hits it (and scalar control accesses)
        clk = prof.clock_ghz / 1000.0                    # cycles per ps
        self.rate = {"hit": prof.l2_read_bytes_per_cycle * clk, "miss": prof.hbm_read_bytes_per_cycle * clk,
                     "MTE3": prof.ub_to_l2_bytes_per_cycle * clk, "FIXP": prof.l2_write_bytes_per_cycle * clk}
        self.mte_startup = prof.cycles_to_ps(prof.mte_startup_cycles)
        self.dma_startup = int(prof.dma_startup_ns * ps)
        self.jitter = None        # jitter.Jitter: seeded perturbation of flag latencies (None: the profile's)

    def server(self, name: str, gbps: float, die: int) -> Server:
        s = self.servers.get(name)
        if s is None:
            s = self.servers[name] = Server(name, gbps, die, [] if self.log_usage else None)
        return s

    def link(self, src: int, dst: int) -> tuple[list[Server], int]:
        """Servers and latency (ps) of the fabric between two different dies."""
        p = self.prof
        if p.chip_of(src) == p.chip_of(dst):
            return ([self.server(f"d2d.tx{src}", p.d2d_gbps, src), self.server(f"d2d.rx{dst}", p.d2d_gbps, dst)],
                    int(p.d2d_latency_ns * 1000))
        gbps, lat = p.fabric_gbps, p.fabric_latency_ns
        if p.server_of(src) != p.server_of(dst):
            gbps *= 1.0 - p.inter_node_bw_loss
            lat += p.inter_node_latency_ns
        servers = [self.server(f"ub.tx{src}", gbps, src), self.server(f"ub.rx{dst}", gbps, dst)]
        if p.pair_link_gbps > 0:        # a full mesh: the pair's own link as well as the dies' ports
            a, b = sorted((p.chip_of(src), p.chip_of(dst)))
            servers.append(self.server(f"link{a}-{b}.{'ab' if p.chip_of(src) == a else 'ba'}", p.pair_link_gbps,
                                       p.chip_of(src) * p.dies_per_chip))
        return servers, int(lat * 1000)

    def scalar_lat(self, core_die: int, gm_die: int, round_trip: bool) -> int:
        """Latency (ps) of a scalar access to a GM word (a flag, a counter): an L2 hit, plus the fabric across dies."""
        key = (core_die, gm_die, round_trip)
        lat = self._scalar.get(key)
        if lat is None:
            lat = self.l2_lat
            if gm_die != core_die:
                lat += self.link(core_die, gm_die)[1] * (2 if round_trip else 1)
            self._scalar[key] = lat
        return lat

    def _memory(self, die: int) -> tuple:
        p = self.prof
        return (self.caches.of(die), self.server(f"l2.{die}", p.l2_gbps, die),
                self.server(f"hbm{die}", p.hbm_gbps, die))

    def path(self, mover: str, core_die: int, src_die, dst_die, dma_engine: int = 0) -> Route:
        """The route of one transfer. ``src_die``/``dst_die`` are the dies of GM operands, or None for a
        core-local operand."""
        key = (mover, core_die, src_die, dst_die, dma_engine)
        r = self._cache.get(key)
        if r is not None:
            return r
        p = self.prof
        r = Route()
        if src_die is not None:
            r.read_cache, r.read_l2, r.read_hbm = self._memory(src_die)
        if dst_die is not None:
            r.write_cache, r.write_l2, r.write_hbm = self._memory(dst_die)
        if mover == "DMA":
            r.engine = self.server(f"dma{core_die}.{dma_engine}", p.dma_gbps, core_die)
            r.startup = self.dma_startup
            a, b = src_die, dst_die
        else:
            r.startup = self.mte_startup
            r.rate_hit, r.rate_miss = self.rate["hit"], self.rate["miss"]
            r.rate_write = self.rate.get(mover, 0.0)
            # the core sits on core_die: a read pulls src -> core, a write pushes core -> dst
            a, b = (src_die, core_die) if src_die is not None else (core_die, dst_die)
        if a is not None and b is not None and a != b:
            links, r.link_lat = self.link(a, b)
            r.links = tuple(links)
            r.send_links = (links[0],) + tuple(links[2:])
            r.recv_links = (links[1],)
            if mover != "DMA":
                # a core keeps at most remote_outstanding_bytes in flight; each request waits a round trip (there
                # and back over the fabric, answered by the owner's L2)
                rtt = 2 * r.link_lat + self.l2_lat
                r.remote_rate = p.remote_outstanding_bytes / rtt
        r.key = key
        far = [d for d in (src_die, dst_die) if d is not None and d != core_die]
        if far:
            r.stage = RELAY if len(far) == 2 else WRITE if dst_die in far else READ
            r.hop_out = self.link(core_die, far[0])[1]
            r.hop_back = self.link(far[-1], core_die)[1]
        self._cache[key] = r
        return r


def burst_bytes(blocks: int, block_bytes: int, burst: int) -> int:
    """Bytes a copy engine actually moves: whole bursts per contiguous block."""
    return blocks * (-(-block_bytes // burst) * burst)


def cube_cycles(prof: HardwareProfile, m: int, n: int, k: int, k0: int) -> int:
    """Cycles of one mmad: one (16 x k0 x 16) fractal MAC block per cycle, plus start-up."""
    return prof.cube_startup_cycles + (-(-m // prof.cube_m)) * (-(-n // prof.cube_n)) * (-(-k // k0))


def vector_cycles(prof: HardwareProfile, nbytes: int, cycles_per_repeat: float) -> int:
    """Cycles of one vector instruction over ``nbytes`` (the widest operand's 32-byte blocks): 256-byte repeats,
    issue start-up once per 255 repeats (an API call over more data loops in hardware)."""
    repeats = max(1, -(-nbytes // prof.vec_bytes_per_repeat))
    launches = -(-repeats // prof.vec_max_repeat)
    return int(launches * prof.vec_startup_cycles + repeats * cycles_per_repeat)
