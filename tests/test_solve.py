"""Solvers against the brute-force oracle on random small DAGs, plus errors and speed."""

import math
import time

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner import synthetic
from partitioner.cluster import Cluster
from partitioner.cost import evaluate, graph_order
from partitioner.errors import ColocationError, MemoryLimitError, StageCountError
from partitioner.solve import solve


@st.composite
def problems(draw):
    """A random DAG of 2-9 ops (plain DiGraph, no index), 2-4 stages, a cluster and options."""
    n = draw(st.integers(2, 9))
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(f"v{i}", fwd=draw(st.integers(1, 20)) * 1e-3, bwd=draw(st.integers(0, 40)) * 1e-3,
                   params=draw(st.integers(0, 5)) * 1000, out_bytes=draw(st.integers(0, 8)) * 1_000_000)
        for j in range(i):
            if draw(st.booleans()):
                g.add_edge(f"v{j}", f"v{i}")
    p = draw(st.integers(2, min(4, n)))
    kind = draw(st.sampled_from(["free", "uniform", "hetero"]))
    if kind == "free":
        cluster = None
    elif kind == "uniform":
        cluster = Cluster.uniform(p, bandwidth=draw(st.sampled_from([1e9, 5e9, 1e11])), latency=1e-4)
    else:
        cluster = Cluster.heterogeneous(
            [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(p)],
            bandwidths=[draw(st.sampled_from([1e9, 1e10])) for _ in range(p - 1)],
            latencies=[draw(st.sampled_from([0.0, 1e-3])) for _ in range(p - 1)])
    total_mem = sum(4 * d["params"] + 4 * d["out_bytes"] for _, d in g.nodes(data=True))
    frac = draw(st.sampled_from([None, None, 0.5, 0.8]))
    opts = dict(cluster=cluster, microbatches=draw(st.integers(1, 4)),
                schedule=draw(st.sampled_from(["1f1b", "gpipe"])), training=draw(st.booleans()),
                memory_limit=None if frac is None or total_mem == 0 else frac * total_mem)
    return g, p, opts


def oracle(g, p, **opts):
    try:
        return synthetic.brute_force(g, p, **opts)
    except MemoryLimitError:
        return None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_solvers_match_brute_force(case):
    g, p, opts = case
    best = oracle(g, p, **opts)
    if best is None:
        for method in ("auto", "cpsat"):
            with pytest.raises(MemoryLimitError):
                solve(g, p, method=method, **opts)
        return
    order = graph_order(g)[1]
    best_in_order = oracle(g, p, order=order, **opts)
    for method in ("cpsat", "auto", "dp"):
        try:
            part = solve(g, p, method=method, **opts)
        except MemoryLimitError:
            assert method == "dp" and best_in_order is None
            continue
        synthetic.assert_valid(g, part)
        assert part.memory_ok
        assert part.lower_bound <= best.bottleneck * (1 + 1e-6)
        if method == "dp":
            assert part.bottleneck == pytest.approx(best_in_order.bottleneck, rel=1e-9)
        else:
            assert part.bottleneck == pytest.approx(best.bottleneck, rel=1e-6)
            assert part.optimal
    assert solve(g, p, method="auto", **opts).stage_of == solve(g, p, method="auto", **opts).stage_of


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 10_000))
def test_colocation_matches_brute_force(n, seed):
    g = synthetic.random_dag(n, seed=seed, edge_prob=0.4)
    names = graph_order(g)[1]
    group = [names[0], names[-1]] if seed % 2 else [names[n // 2], names[-1]]
    cluster = Cluster.uniform(2, bandwidth=1e10)
    try:
        best = synthetic.brute_force(g, 2, cluster=cluster, colocate=[group])
    except MemoryLimitError:
        return
    except ColocationError:
        return
    try:
        part = solve(g, 2, cluster=cluster, colocate=[group], method="cpsat")
    except ColocationError:
        return  # the program order has no allowed cut left; brute force found one on another order
    synthetic.assert_valid(g, part, colocate=[group])
    assert part.bottleneck == pytest.approx(best.bottleneck, rel=1e-6)


@pytest.mark.parametrize("kind", list(synthetic.SUITES))
def test_suites_valid_and_better_than_baselines(kind):
    g = synthetic.generate(kind, 60, seed=1)
    cluster = Cluster.uniform(4, bandwidth=2.5e10, latency=5e-6)
    best = solve(g, 4, cluster=cluster, microbatches=8, time_limit=3)
    synthetic.assert_valid(g, best)
    for method in ("uniform", "params", "blocks", "dp"):
        other = solve(g, 4, cluster=cluster, microbatches=8, method=method)
        synthetic.assert_valid(g, other, memory=False)
        synthetic.assert_near(best, other)
    assert best.lower_bound <= best.bottleneck


def test_transformer_head_beats_params_baseline():
    g = synthetic.transformer(8, seed=0)
    cluster = Cluster.uniform(4, bandwidth=5e10)
    best = solve(g, 4, cluster=cluster, microbatches=8)
    assert best.optimal
    assert solve(g, 4, cluster=cluster, microbatches=8, method="params").bottleneck > 1.1 * best.bottleneck


def test_memory_error_names_the_least_memory():
    g = synthetic.chain(10, seed=0)
    with pytest.raises(MemoryLimitError, match=r"at least .*largest op alone") as err:
        solve(g, 2, memory_limit=1000)
    assert err.value.needed > 1000


def test_stage_and_colocation_errors():
    g = synthetic.chain(3, seed=0)
    with pytest.raises(StageCountError, match="only 3 ops"):
        solve(g, 4)
    with pytest.raises(ColocationError, match="not in the graph"):
        solve(g, 2, colocate=[["op0", "nope"]])
    with pytest.raises(ColocationError, match="movable blocks"):
        solve(g, 2, colocate=[["op0", "op2"]])
    with pytest.raises(StageCountError, match="devices"):
        solve(g, 3, cluster=Cluster.uniform(2, bandwidth=1e9))


def test_slow_link_costs_more_and_moves_the_cut():
    g = synthetic.chain(8, seed=3)
    fast = solve(g, 2, cluster=Cluster.uniform(2, bandwidth=4e11))
    slow = solve(g, 2, cluster=Cluster.uniform(2, bandwidth=1e9))
    assert slow.bottleneck > fast.bottleneck


def test_node_boundary_is_priced_on_the_inter_node_link():
    # 2 nodes x 2 devices: a skip tensor from stage 0 to stage 2 crosses the node boundary.
    profile = {"kind": "smp.profile", "device": {"name": "x"}, "topology": {"nodes": 2, "devices_per_node": 2},
               "links": {"intra_node": {"bandwidth": 1e12}, "inter_node": {"bandwidth": 1e9}}}
    cluster = Cluster.from_profile(profile)
    g = synthetic.unet(1, blocks=1, seed=0)
    part = solve(g, 4, cluster=cluster)
    for t in part.transfers:
        inter = (t.src_stage < 2) != (t.dst_stage < 2)
        assert t.seconds == pytest.approx(t.bytes / (1e9 if inter else 1e12))


def test_dp_speed_10k_ops_64_stages():
    g = synthetic.transformer(1000, seed=0)  # 10,004 ops
    t = time.perf_counter()
    part = solve(g, 64, cluster=Cluster.uniform(64, bandwidth=5e10, latency=5e-6), method="dp",
                 microbatches=128)
    assert time.perf_counter() - t < 10
    assert part.optimal and math.isfinite(part.bottleneck)
    assert len({s for s in part.stage_of.values()}) == 64


def test_evaluate_matches_solver_report():
    g = synthetic.inception(3, seed=2)
    cl = Cluster.uniform(3, bandwidth=1e10)
    part = solve(g, 3, cluster=cl, time_limit=2)
    again = evaluate(g, part.stage_of, cluster=cl)
    assert again.bottleneck == pytest.approx(part.bottleneck)
