"""The timing model: shared-bandwidth servers, the path a copy takes, and the cost of each instruction class.

Time is integer picoseconds. Every constant comes from the ``HardwareProfile``; nothing here is tuned to a result.

Shared resources are first-come-first-served servers with a bandwidth: each die's HBM, each die's fabric send and
receive ports, the die-to-die link of a chip, each DMA engine. A transfer becomes ready in simulated-time order; its
mover (MTE2/MTE3/FIXP of its core, or the die's DMA engine, which also queues descriptors) starts then, and its bytes
queue at each server on the path independently, holding it for ``bytes / server bandwidth``. The pipe is busy until
its mover and every server have passed the bytes; the data is visible one path latency later. Many cores therefore
overlap their copies until a shared server saturates, and contention between cores and dies shows up in modeled time.

modeled as: each server serves whole transfers in arrival order (no interleaving of two transfers' bytes); the
aggregate bandwidth is right, the completion order among simultaneous transfers is FIFO rather than fair-share, and a
server's queue never holds back another server (a transfer is a fluid stream, not a store-and-forward packet).
"""
from __future__ import annotations

from .profile import HardwareProfile


class Server:
    """A shared bandwidth resource (bytes per picosecond)."""

    __slots__ = ("name", "bw", "free", "busy_ps", "bytes")

    def __init__(self, name: str, gbps: float):
        self.name = name
        self.bw = gbps / 1000.0   # GB/s -> bytes/ps
        self.free = 0
        self.busy_ps = 0
        self.bytes = 0


class Paths:
    """Resolves which servers, bandwidth and latency a transfer between two places uses."""

    def __init__(self, prof: HardwareProfile):
        self.prof = prof
        self.servers: dict[str, Server] = {}
        self._cache: dict = {}
        ps = 1000.0
        self.gm_lat = int(prof.gm_latency_ns * ps)
        self.mover_bw = {  # bytes/ps of one core's data movers
            "MTE2": prof.ub_to_hbm_bytes_per_cycle * prof.clock_ghz / 1000.0,
            "MTE3": prof.ub_to_hbm_bytes_per_cycle * prof.clock_ghz / 1000.0,
            "FIXP": prof.l0c_to_l1_bytes_per_cycle * prof.clock_ghz / 1000.0,
            "MTE1": prof.l1_to_l0b_bytes_per_cycle * prof.clock_ghz / 1000.0,
            "DMA": prof.dma_gbps / 1000.0,
        }
        self.mte_startup = prof.cycles_to_ps(prof.mte_startup_cycles)
        self.dma_startup = int(prof.dma_startup_ns * ps)

    def server(self, name: str, gbps: float) -> Server:
        s = self.servers.get(name)
        if s is None:
            s = self.servers[name] = Server(name, gbps)
        return s

    def link(self, src: int, dst: int) -> tuple[list[Server], int]:
        """Servers and latency (ps) of the fabric between two different dies."""
        p = self.prof
        if p.chip_of(src) == p.chip_of(dst):
            return ([self.server(f"d2d.tx{src}", p.d2d_gbps), self.server(f"d2d.rx{dst}", p.d2d_gbps)],
                    int(p.d2d_latency_ns * 1000))
        gbps, lat = p.fabric_gbps, p.fabric_latency_ns
        if p.server_of(src) != p.server_of(dst):
            gbps *= 1.0 - p.inter_node_bw_loss
            lat += p.inter_node_latency_ns
        return ([self.server(f"ub.tx{src}", gbps), self.server(f"ub.rx{dst}", gbps)], int(lat * 1000))

    def path(self, mover: str, core_die: int, src_die, dst_die, dma_engine: int = 0):
        """(servers, mover bandwidth bytes/ps, start-up ps, latency ps) of one transfer.

        ``src_die``/``dst_die`` are the dies of GM operands, or None for a core-local operand.
        """
        key = (mover, core_die, src_die, dst_die, dma_engine)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        p = self.prof
        servers: list[Server] = []
        lat = 0
        for gm_die in (src_die, dst_die):      # the HBM of each GM operand (once when both sit on one die)
            if gm_die is None:
                continue
            hbm = self.server(f"hbm{gm_die}", p.hbm_gbps)
            if hbm not in servers:
                servers.append(hbm)
        if mover == "DMA":
            servers.insert(0, self.server(f"dma{core_die}.{dma_engine}", p.dma_gbps))
            a, b = src_die, dst_die
            startup = self.dma_startup
            lat = self.gm_lat
        else:
            # the core sits on core_die: a read pulls src -> core, a write pushes core -> dst
            a, b = (src_die, core_die) if src_die is not None else (core_die, dst_die)
            startup = self.mte_startup
            lat = self.gm_lat
        if a is not None and b is not None and a != b:
            link_servers, link_lat = self.link(a, b)
            servers.extend(link_servers)
            lat += link_lat
        res = (tuple(servers), self.mover_bw[mover], startup, lat)
        self._cache[key] = res
        return res


def burst_bytes(blocks: int, block_bytes: int, burst: int) -> int:
    """Bytes a copy engine actually moves: whole bursts per contiguous block."""
    return blocks * (-(-block_bytes // burst) * burst)


def cube_cycles(prof: HardwareProfile, m: int, n: int, k: int, k0: int) -> int:
    """Cycles of one mmad: one (16 x k0 x 16) fractal MAC block per cycle, plus start-up."""
    return prof.cube_startup_cycles + (-(-m // prof.cube_m)) * (-(-n // prof.cube_n)) * (-(-k // k0))


def vector_cycles(prof: HardwareProfile, nbytes: int, cycles_per_repeat: float) -> int:
    """Cycles of one vector instruction over ``nbytes`` (the widest operand): 256-byte repeats, issue start-up
    once per 255 repeats (an API call over more data loops in hardware)."""
    repeats = max(1, -(-nbytes // prof.vec_bytes_per_repeat))
    launches = -(-repeats // prof.vec_max_repeat)
    return int(launches * prof.vec_startup_cycles + repeats * cycles_per_repeat)
