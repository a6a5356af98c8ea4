"""Stateless expert service (xccl.service): results, server and client deaths, slot release, modeled time."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.errors import ArgumentError, DTypeError, ShapeError
from xccl.comm import XcclError
from xccl.service import ExpertService, replica_placement, service_reference, silence_bounds

C, S, E, H, K, B, R = 3, 4, 8, 64, 2, 8, 6          # clients, servers, experts, hidden, top-k, tokens, requests
CLIENTS, SERVERS = list(range(C)), list(range(C, C + S))   # the monitor takes die C + S


def _inputs(c=C, e=E, h=H, k=K, b=B, r=R, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, h, h, generator=g) / 8).to(torch.bfloat16)
    x = torch.randn(c, r, b, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(c * r * b)]).reshape(c, r, b, k)
    gate = torch.rand(c, r, b, k, generator=g)
    return w, x, ids, gate


def _run(kill=(), phantom=False, inputs=None, clients=CLIENTS, servers=SERVERS, **kw):
    w, x, ids, gate = inputs or _inputs()
    pod = Pod(cloudmatrix384(dies=max(clients + servers) + 2), trace=False, max_modeled_us=2000.0)  # hangs fail fast
    svc = ExpertService(pod, clients, servers, num_experts=w.shape[0], hidden=w.shape[1], top_k=ids.shape[-1],
                        max_tokens=ids.shape[2], weights=None if phantom else w, phantom=phantom, **kw)
    res = svc.run(ids.numpy(), None if phantom else x, None if phantom else gate, kill=kill)
    return svc, res


def _bits(out):
    return torch.from_numpy(out.astype(np.float32))


@pytest.fixture(scope="module")
def baseline():
    return _run()


def test_results_equal_the_reference_bitwise(baseline):
    svc, res = baseline
    w, x, ids, gate = _inputs()
    assert torch.equal(_bits(res.out), service_reference(x, ids, gate, w).float())
    assert (res.completions == 1).all() and (res.resends == 0).all()
    assert not res.dead and not res.run.parked
    # every row came from a server that hosts its expert, the primary replica while all servers live
    prim = replica_placement(E, S, 2)[:, 0]
    assert (res.row_server == np.array(SERVERS)[prim[ids.numpy().reshape(C, R, -1)]]).all()
    # each send was served once: servers' counts add up to the clients' sends
    assert sum(v.sum() for v in res.served.values()) == res.sends.sum()
    for d in SERVERS:                      # clients went offline when done; servers released their slots
        assert (res.slot_states[d] == 0).all() and (res.release_reason[d] == 1).all()
    assert (np.diff(res.completion_us, axis=1) > 0).all()


def test_killed_server_every_request_completes_once_via_replicas(baseline):
    _, base = baseline
    dead, t_kill = SERVERS[1], 60.0
    svc, res = _run(kill=[(dead, t_kill)])
    w, x, ids, gate = _inputs()
    assert torch.equal(_bits(res.out), service_reference(x, ids, gate, w).float())   # nothing lost or wrong
    assert (res.completions == 1).all()                                              # each request id once
    assert res.resends.sum() >= 1 and not res.run.parked
    # detected by the monitor within dead_after + two heartbeats (+ fabric latency) of the kill
    assert list(res.dead) == [dead] and t_kill < res.dead[dead] < t_kill + 10.0 + 2 * 2.0 + 2.0
    # rows of requests completed after the detection never came from the dead server; replicas hosted them
    late = res.completion_us > res.dead[dead] + 25.0
    assert late.sum() >= C and (res.row_server[late] != dead).all()
    pl = replica_placement(E, S, 2)
    flat = ids.numpy().reshape(C, R, -1)
    assert all(res.row_server[c, r, q] in [SERVERS[s] for s in pl[flat[c, r, q]]]
               for c in range(C) for r in range(R) for q in range(B * K))
    # throughput over the run drops by less than the dead die's share of the servers
    assert res.throughput_per_us < base.throughput_per_us
    assert res.throughput_per_us > (1 - 1 / S) * base.throughput_per_us
    # the live servers released every slot at the end
    for d in SERVERS:
        if d != dead:
            assert (res.slot_states[d] == 0).all()


def _request_us(res):
    return np.diff(np.c_[np.full(len(res.completion_us), res.start_us), res.completion_us], axis=1)


def test_clients_detect_a_dead_server_by_its_silent_heartbeat(baseline):
    """With the monitor slow to judge (dead_after 400 us), the clients' own check (no heartbeat over a 6 us poll
    timeout) finds the dead server and resends; the monitor's verdict comes long after the last request."""
    dead, t_kill = SERVERS[2], 60.0
    _, res = _run(kill=[(dead, t_kill)], dead_after_us=400.0)
    w, x, ids, gate = _inputs()
    assert torch.equal(_bits(res.out), service_reference(x, ids, gate, w).float())
    assert (res.completions == 1).all() and res.resends.sum() >= 1
    assert res.dead[dead] > np.nanmax(res.completion_us) > t_kill
    # one stall per client at most: detection (two poll timeouts + a heartbeat) and a second round trip
    assert _request_us(res).max() < 2 * _request_us(baseline[1]).max() + 2 * 6.0 + 2.0


def test_killed_client_slots_are_released(baseline):
    victim = CLIENTS[1]
    t_kill = baseline[1].completion_us[victim, 1] + 10.0     # request 2 sent, its results not read back yet
    svc, res = _run(kill=[(victim, t_kill)])
    w, x, ids, gate = _inputs()
    others = [0, 2]
    assert torch.equal(_bits(res.out[others]), service_reference(x, ids, gate, w).float()[others])
    assert (res.completions[others] == 1).all()
    done = res.completions[victim]
    assert done[0] == 1 and done[-1] == 0 and (np.diff(done) <= 0).all()     # completed up to the kill, then lost
    assert (res.completion_us[victim][done == 1] < t_kill).all()
    assert list(res.dead) == [victim] and t_kill < res.dead[victim] < t_kill + 16.0
    for d in SERVERS:                      # every server released the dead client's slot (and the others')
        assert res.slot_states[d][victim] == 0 and res.slot_reasons[d][victim] == 2
        assert res.release_reason[d][victim] == 2
        assert (res.release_reason[d][others] == 1).all()
    # the client died holding finished results on some servers: released without a read-back
    assert any(res.release_held[d][victim] == 2 for d in SERVERS)
    assert not res.run.parked


def test_client_killed_while_the_servers_compute_is_released_by_their_cas():
    """hidden 512 on one AIC: a batch outlasts the monitor's verdict, so each server's CAS 1 -> 2 finds the slot
    offline (3) and releases it, dropping the answer."""
    c, s, e, h, k, b, r = 3, 3, 6, 512, 2, 16, 2
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(c * r * b)]).reshape(c, r, b, k).numpy()
    pod = Pod(cloudmatrix384(dies=c + s + 1), trace=False)
    svc = ExpertService(pod, range(c), range(c, c + s), num_experts=e, hidden=h, top_k=k, max_tokens=b,
                        phantom=True, server_cores=1)
    res = svc.run(ids, kill=[(0, 14.0)])
    assert res.completions[0].sum() == 0 and (res.completions[1:] == 1).all()
    for d in range(c, c + s):
        assert res.release_held[d].tolist() == [1, 0, 0] and res.release_reason[d].tolist() == [2, 1, 1]
        assert res.slot_states[d].tolist() == [0, 0, 0] and res.served[d][0] == 0


def test_timing_only_run_has_the_numeric_modeled_time(baseline):
    _, base = baseline
    _, ph = _run(phantom=True)
    assert ph.out is None
    np.testing.assert_array_equal(ph.completion_us, base.completion_us)
    assert ph.run.modeled_us == base.run.modeled_us
    _, ph2 = _run(phantom=True)                                        # deterministic
    np.testing.assert_array_equal(ph2.completion_us, ph.completion_us)


def test_grouped_gemm_tiles_over_m_k_and_n():
    """hidden 256: two K tiles accumulate in L0C, two N tiles; 2 clients x 80 rows per expert: M tiles of 128
    split a slot's run."""
    inputs = _inputs(c=2, e=2, h=256, k=2, b=80, r=1, seed=1)
    w, x, ids, gate = inputs
    _, res = _run(inputs=inputs, clients=[0, 1], servers=[2, 3])
    assert torch.equal(_bits(res.out), service_reference(x, ids, gate, w).float())
    ref32 = torch.einsum("crbh,crbkhn->crbkn", x.float(), w.float()[ids]).mul(gate[..., None]).sum(3)
    assert (torch.from_numpy(res.out.astype(np.float32)) - ref32).abs().max() < 0.05 * ref32.abs().max()


def test_no_live_replica_is_a_protocol_error():
    with pytest.raises(XcclError, match="no live replica"):
        _run(kill=[(SERVERS[0], 30.0)], replicas=1)


def test_bad_arguments_name_the_limit():
    w, x, ids, gate = _inputs()
    pod = Pod(cloudmatrix384(dies=8), trace=False)
    kw = dict(num_experts=E, hidden=H, top_k=K, max_tokens=B, weights=w)
    with pytest.raises(ArgumentError, match="replicas=5 out of range 1..4"):
        ExpertService(pod, CLIENTS, SERVERS, replicas=5, **kw)
    with pytest.raises(ShapeError, match="placement"):
        ExpertService(pod, CLIENTS, SERVERS, placement=np.zeros((E, 3), np.int64), **kw)
    with pytest.raises(ArgumentError, match="distinct per expert"):
        ExpertService(pod, CLIENTS, SERVERS, placement=np.zeros((E, 2), np.int64), **kw)
    with pytest.raises(DTypeError, match="placement"):
        ExpertService(pod, CLIENTS, SERVERS, placement=replica_placement(E, S, 2) + 0.5, **kw)
    with pytest.raises(ArgumentError, match="hidden=72"):
        ExpertService(pod, CLIENTS, SERVERS, **{**kw, "hidden": 72})
    with pytest.raises(ArgumentError, match="distinct dies"):
        ExpertService(pod, [0, 1], [1, 2], **kw)
    svc = ExpertService(pod, CLIENTS, SERVERS, **kw)
    with pytest.raises(ArgumentError, match="allowed 0..7"):
        svc.run(ids.numpy() + 1, x, gate)
    with pytest.raises(ShapeError, match="tokens<=8"):
        svc.run(np.zeros((C, 1, B + 1, K), np.int64), x, gate)
    with pytest.raises(ArgumentError, match="monitor 7 must stay alive"):
        svc.run(ids.numpy(), x, gate, kill=[(7, 10.0)])


def test_one_aic_per_server_gives_the_same_bits(baseline):
    _, res = _run(server_cores=1)
    assert np.array_equal(res.out.view(np.uint16), baseline[1].out.view(np.uint16))
    assert (res.completions == 1).all()


@pytest.mark.slow
def test_timing_only_scale_server_kill():
    """6 clients, 6 servers x 4 AICs, 24 experts x 2 replicas, 16 tokens x top-4 per request, hidden 512; the
    run is compute-bound, so the surviving servers slow down too."""
    c, s, e, h, k, b, r = 6, 6, 24, 512, 4, 16, 6
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(c * r * b)]).reshape(c, r, b, k).numpy()
    runs = []
    for kill in ([], [(c + 1, 100.0)]):
        pod = Pod(cloudmatrix384(dies=c + s + 1), trace=False)
        svc = ExpertService(pod, range(c), range(c, c + s), num_experts=e, hidden=h, top_k=k, max_tokens=b,
                            phantom=True)
        runs.append(svc.run(ids, kill=kill))
    base, hit = runs
    assert (base.completions == 1).all() and (hit.completions == 1).all() and hit.resends.sum() >= 1
    assert hit.throughput_per_us > (1 - 1 / s) * base.throughput_per_us


# ---------------------------------------------------------------------------------------------- monitor placement
def test_a_client_that_hosts_the_monitor_cannot_be_killed():
    """Before: the kill was accepted, the monitor died with its client, nobody declared the client dead and the
    servers waited for it until the run's time bound ("a livelock")."""
    w, x, ids, gate = _inputs()
    pod = Pod(cloudmatrix384(dies=7), trace=False, max_modeled_us=300.0)
    svc = ExpertService(pod, CLIENTS, SERVERS, num_experts=E, hidden=H, top_k=K, max_tokens=B, weights=w, monitor=0)
    with pytest.raises(ArgumentError, match=r"kill die 0: client 0 also hosts the service's monitor \(monitor=0\)"):
        svc.run(ids.numpy(), x, gate, kill=[(0, 30.0)])
    res = svc.run(ids.numpy(), x, gate, kill=[(1, 30.0)])         # a client without the monitor: released
    assert list(res.dead) == [1] and (res.completions[[0, 2]] == 1).all()


def test_a_run_whose_monitor_was_killed_says_so():
    w, x, ids, gate = _inputs()
    pod = Pod(cloudmatrix384(dies=7), trace=False, max_modeled_us=300.0)
    svc = ExpertService(pod, CLIENTS, SERVERS, num_experts=E, hidden=H, top_k=K, max_tokens=B, weights=w, monitor=0)
    pod.kill_die(0, at_us=30.0)                                   # behind the service's back
    with pytest.raises(XcclError, match="the monitor's die 0 was killed"):
        svc.run(ids.numpy(), x, gate)


# ---------------------------------------------------------------------------------------------- failure detection
@pytest.mark.parametrize("kw, match", [
    (dict(heartbeat_us=1.0, dead_after_us=2.01), r"dead_after_us=2.01: healthy beats land up to 1.004 us apart.*"
                                                 r"more than 2.209 us"),
    (dict(heartbeat_us=1.0, poll_timeout_us=1.0), r"poll_timeout_us=1.0: .* up to 1.004 us apart"),
    (dict(heartbeat_us=0.0), "heartbeat_us=0.0"),
    (dict(dead_after_us=float("nan")), "dead_after_us=nan"),
])
def test_detection_windows_below_a_healthy_silence_are_rejected(kw, match):
    """The windows must exceed the modeled gap between a healthy member's beats (its beat core: the heartbeat plus
    two instruction issues) plus, for the monitor, its own read period (the heartbeat plus a local round trip)."""
    pod = Pod(cloudmatrix384(dies=8), trace=False)
    with pytest.raises(ArgumentError, match=match):
        ExpertService(pod, CLIENTS, SERVERS, num_experts=E, hidden=H, top_k=K, max_tokens=B, phantom=True, **kw)


def _fault_free(heartbeat_us, hidden, tokens, server_cores, far, slack=1e-3):
    """A timing-only run at the tightest windows the constructor accepts (each bound plus ``slack``)."""
    clients, servers, monitor = [0, 1, 2], ([17, 18, 35] if far else [3, 4, 5]), (20 if far else 6)
    prof = cloudmatrix384(dies=36)
    member_us, read_us = silence_bounds(prof, monitor, heartbeat_us)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(3 * 3 * tokens)]).reshape(3, 3, tokens, 2)
    svc = ExpertService(Pod(prof, trace=False, max_modeled_us=1e4), clients, servers, num_experts=6, hidden=hidden,
                        top_k=2, max_tokens=tokens, phantom=True, monitor=monitor, server_cores=server_cores,
                        heartbeat_us=heartbeat_us, poll_timeout_us=member_us * (1 + slack),
                        dead_after_us=(member_us + read_us) * (1 + slack))
    return svc.run(ids.numpy())


@settings(max_examples=8, deadline=None)
@given(heartbeat_us=st.sampled_from([0.1, 0.5, 2.0, 5.0]), shape=st.sampled_from([(64, 8, 4), (512, 32, 1),
                                                                                 (2048, 32, 2)]),
       far=st.booleans())
def test_fault_free_runs_at_the_tightest_accepted_windows_declare_nobody_dead(heartbeat_us, shape, far):
    """Before: heartbeat 1 us / dead-after 2.01 us passed validation and healthy members were declared dead, the
    working core posted the beats between its steps. A beat core per die keeps the gaps within the modeled bound
    whatever the heartbeat, the tile sizes, the payloads and the fabric distance."""
    res = _fault_free(heartbeat_us, *shape, far)
    assert not res.dead and res.resends.sum() == 0 and (res.completions == 1).all()


def test_big_tiles_at_the_default_windows_keep_servers_alive():
    """Before: with hidden 4096 a server posted one heartbeat per 128 x 128 output tile (32 K steps, ~15 us), so
    the clients' 6 us poll timeout declared healthy servers dead and the run failed with "no live replica"."""
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(C * 2 * 16)]).reshape(C, 2, 16, K)
    pod = Pod(cloudmatrix384(dies=8), trace=False, max_modeled_us=1e4)
    svc = ExpertService(pod, CLIENTS, SERVERS, num_experts=E, hidden=4096, top_k=K, max_tokens=16, phantom=True)
    res = svc.run(ids.numpy())
    assert not res.dead and res.resends.sum() == 0 and (res.completions == 1).all()
