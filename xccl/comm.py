"""The communicator: XCCL's areas in every member die's global memory.

Every die of a communicator holds three areas (DESIGN.md 4):

- **app data area**: the user's own tensors (KV cache, activations). XCCL reads and writes them, never allocates them.
- **metadata area**: 32-byte fields, int32 words, zero at start.

  ``p2p`` fields, array ``meta[die]`` of shape ``(ranks, lanes, 2, 8)`` int32; the field for (peer rank ``r``, lane
  ``c``, kind ``k``) starts at byte ``((r * lanes + c) * 2 + k) * 32`` of the area:

  ====  ===========================================================================================
  kind  0 NOTIFY: written by peer ``r`` sending to this die; 1 ACK: written by peer ``r`` receiving from this die
  word  0 event id | 1 chunk id (last chunk written / consumed) | 2 tail (NOTIFY: chunks written) or head (ACK:
        chunks consumed), cumulative over the communicator's life | 3 chunks in this transfer | 4 bytes in this
        transfer | 5 transfer sequence number (1, 2, ... per (peer, lane)) | 6 NOTIFY: the sender's mode flags
        (bit 0: zero-copy), ACK: low half of the receiver's app-area address | 7 NOTIFY: the sender's lane count
        (cores), ACK: high half
  ====  ===========================================================================================

  ``moe`` fields, array ``moe_meta[die]`` of shape ``(ranks, 8)`` int32, one 32-byte field per source rank at byte
  ``r * 32`` (after the p2p fields): 0 event id | 1 offset of the source's data for this die (rows, in the source's
  managed area) | 2 token count | 3 flag (round number when published) | 4-7 reserved.

- **managed data area**: for p2p, a ring per (peer, lane) of ``slots`` fixed-size slots of ``slot_bytes``, allocated
  on first use (``ring(dst_die, src_die)``: shape ``(lanes, slots, slot_bytes)`` uint8 on ``dst_die``); dispatch and
  combine windows are allocated by those ops in the same area.

A lane is one pair of computing cores (sender core ``c`` <-> receiver core ``c``); a transfer over ``cores`` cores uses
lanes ``0 .. cores-1``, chunk ``i`` travelling on lane ``i % cores``.
"""
from __future__ import annotations

import numpy as np

from ascend_emu import Pod
from ascend_emu.arguments import check_int
from ascend_emu.errors import AddressError, ArgumentError, DTypeError

FIELD_BYTES = 32
FIELD_WORDS = 8
NOTIFY, ACK = 0, 1
W_EVENT, W_CHUNK, W_TAIL, W_NCHUNKS, W_BYTES, W_SEQ, W_FLAGS, W_LANES = 0, 1, 2, 3, 4, 5, 6, 7
FLAG_ZERO_COPY = 1
M_EVENT, M_OFFSET, M_COUNT, M_FLAG = 0, 1, 2, 3


class XcclError(ArgumentError):
    """A protocol violation seen by a kernel: wrong event id, a transfer that does not fit its peer's."""


def check_event_id(event_id, arg: str = "event_id") -> int:
    """An event id travels as one int32 word: an integer (Python or numpy; not a bool, not a float such as 7.9,
    which would silently become 7) in int32 range."""
    info = np.iinfo(np.int32)
    return check_int(event_id, arg, int(info.min), int(info.max))


def integer_ids(values, arg: str) -> np.ndarray:
    """Ids (experts, ranks, servers) from a numpy array, torch tensor or nested lists as an int64 array. A
    non-integer dtype raises ``DTypeError`` naming ``arg`` instead of being truncated (3.7 must not route to 3)."""
    dtype = getattr(values, "dtype", None)
    if dtype is not None and type(values).__module__.startswith("torch"):
        if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
            raise DTypeError(f"{arg} is {dtype}: ids must be integers")
        values = values.detach().cpu().numpy()
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iu":
        raise DTypeError(f"{arg} is {a.dtype}: ids must be integers")
    return a.astype(np.int64)


class Communicator:
    """XCCL state over ``dies`` of ``pod``: metadata fields and managed rings on every member die.

    ``lanes``: the most computing cores one transfer may use; ``slots`` x ``slot_bytes``: each ring (the mtu path
    moves a slot through UB in ``ub_tile``-byte ping-pong pieces, the DMA path in one descriptor per run of slots);
    ``phantom``: managed rings without storage (timing-only runs; metadata always stays real)."""

    def __init__(self, pod: Pod, dies, *, lanes: int = 8, slots: int = 4, slot_bytes: int = 256 * 1024,
                 ub_tile: int = 64 * 1024, phantom: bool = False):
        dies = pod.check_dies(dies)             # distinct dies of this pod
        prof = pod.profile
        check_int(lanes, "lanes", 1, prof.aiv_per_die)
        check_int(slots, "slots", 1)
        check_int(slot_bytes, "slot_bytes", 32)
        check_int(ub_tile, "ub_tile", 32)
        if slot_bytes % 32:
            raise ArgumentError(f"slots={slots}, slot_bytes={slot_bytes}: need >= 1 slot of a positive multiple "
                                f"of 32 bytes")
        self.pod = pod
        self.dies = dies
        self.rank_of = {d: i for i, d in enumerate(dies)}
        self.lanes = lanes
        self.slots = slots
        self.slot_bytes = slot_bytes
        if ub_tile < 32 or ub_tile % 32 or 2 * ub_tile > prof.ub_bytes:
            raise ArgumentError(f"ub_tile={ub_tile}: two ping-pong tiles must fit the {prof.ub_bytes}-byte UB "
                                f"and be 32-byte multiples")
        self.ub_tile = ub_tile
        self.phantom = phantom
        n = len(dies)
        self.meta = {d: pod.alloc(d, (n, lanes, 2, FIELD_WORDS), "int32", name=f"xccl.meta{d}") for d in dies}
        self.moe_meta = {d: pod.alloc(d, (n, FIELD_WORDS), "int32", name=f"xccl.moe_meta{d}") for d in dies}
        self._rings: dict = {}
        # transfer sequence numbers per (src, dst): both sides count transfers in submission order
        self._seq: dict = {}

    @property
    def size(self) -> int:
        return len(self.dies)

    def rank(self, die: int) -> int:
        if isinstance(die, (bool, np.bool_)) or not isinstance(die, (int, np.integer)):
            raise AddressError(f"die {die!r} is not an integer die id (members: dies {self.dies})")
        try:
            return self.rank_of[die]
        except KeyError:
            raise AddressError(f"die {die} is not a member of this communicator (dies {self.dies})") from None

    def field(self, on_die: int, peer_die: int, lane: int, kind: int):
        """The 32-byte p2p field on ``on_die`` for ``peer_die``, ``lane``, kind NOTIFY/ACK: an int32 [8] view."""
        return self.meta[on_die][self.rank(peer_die), lane, kind]

    def ring(self, dst_die: int, src_die: int):
        """The managed ring on ``dst_die`` that ``src_die`` writes into: (lanes, slots, slot_bytes) uint8."""
        key = (dst_die, src_die)
        r = self._rings.get(key)
        if r is None:
            self.rank(dst_die), self.rank(src_die)
            # dense: a ring is written through, slot by slot (its pages come in large steps, memory.zeroed_bytes)
            r = self._rings[key] = self.pod.gm.alloc(dst_die, (self.lanes, self.slots, self.slot_bytes), "uint8",
                                                     phantom=self.phantom, name=f"xccl.ring{dst_die}<-{src_die}",
                                                     dense=True)
        return r

    # ---------------------------------------------------------------- host API (the protocols live in p2p.py)
    def send(self, src, dst_die: int, event_id: int, **kw):
        """Queue a send of GM tensor ``src`` to ``dst_die`` (see ``xccl.p2p.send``); returns a Transfer."""
        from .p2p import send
        return send(self, src, dst_die, event_id, **kw)

    def recv(self, dst, src_die: int, event_id: int, **kw):
        """Queue a receive into GM tensor ``dst`` from ``src_die`` (see ``xccl.p2p.recv``); returns a Transfer."""
        from .p2p import recv
        return recv(self, dst, src_die, event_id, **kw)

    def next_seq(self, src_die: int, dst_die: int, side: str) -> int:
        key = (src_die, dst_die, side)
        self._seq[key] = self._seq.get(key, 0) + 1
        return self._seq[key]
