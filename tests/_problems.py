"""Hypothesis strategies for small planning problems, shared by the solver tests."""

import networkx as nx
from hypothesis import strategies as st

from partitioner.cluster import Cluster
from partitioner.graph import OUTPUT_OP


@st.composite
def problems(draw):
    """A random DAG of 2-9 ops (plain DiGraph, no index), 2-4 stages, a cluster and options; half the
    time with the model's output node reading every op that nothing else reads (as traced graphs have)."""
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
    if draw(st.booleans()):
        sinks = [v for v in g.nodes if g.out_degree(v) == 0]
        g.add_node(f"v{n}", op=OUTPUT_OP, fwd=0.0, bwd=0.0, params=0, out_bytes=0)
        g.add_edges_from((v, f"v{n}") for v in sinks)
    return g, p, opts


@st.composite
def colocated_problems(draw):
    """A random DAG with 1-2 colocation groups of ops anywhere (far apart too) and fractional memory."""
    g, p, opts = draw(problems())
    names = sorted((v for v in g.nodes if g.nodes[v].get("op") != OUTPUT_OP), key=lambda v: int(v[1:]))
    for v in names:  # fractional bytes: the integer model must not round them against a plan
        g.nodes[v]["params"] = draw(st.integers(0, 50)) * 137.3
    groups = [draw(st.lists(st.sampled_from(names), min_size=2, max_size=3, unique=True))
              for _ in range(draw(st.integers(1, 2)))]
    total = sum(synthetic_memory(g, opts))
    frac = draw(st.sampled_from([None, 0.45, 0.6, 0.9]))
    opts["memory_limit"] = None if frac is None or total == 0 else frac * total + draw(st.floats(0, 1))
    return g, p, opts, groups


def synthetic_memory(g, opts):
    factor = 4.0 if opts["training"] else 1.0
    return [factor * d["params"] + 4 * d["out_bytes"] for _, d in g.nodes(data=True)]
