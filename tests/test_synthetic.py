"""The synthetic-graph kit: generators are seeded DAGs with costs; the oracle and assertions work."""

import itertools

import networkx as nx
import pytest

from partitioner import synthetic
from partitioner.cluster import Cluster
from partitioner.cost import evaluate
from partitioner.errors import InvalidAssignmentError


@pytest.mark.parametrize("kind", list(synthetic.SUITES))
def test_generators_are_costed_deterministic_dags(kind):
    g = synthetic.generate(kind, 80, seed=7)
    assert nx.is_directed_acyclic_graph(g.nx) and 40 <= len(g) <= 140
    assert g.total_fwd > 0 and g.total_params > 0
    assert all(d["out_bytes"] >= 0 for _, d in g.nx.nodes(data=True))
    assert synthetic.generate(kind, 80, seed=7) == g
    assert synthetic.generate(kind, 80, seed=8) != g


def test_shapes():
    t = synthetic.transformer(2)
    assert len(t) == 2 * 10 + 4 and t["embed"]["params"] > t["l0_fc1"]["params"]
    u = synthetic.unet(2, blocks=1)
    assert u.nx.has_edge("down0_conv0", "up0_cat")  # the long skip
    e = synthetic.encoder_decoder(2, 2)
    assert e.nx.has_edge("enc_norm", "d1_cross")
    i = synthetic.inception(1, branches=3)
    assert i.nx.in_degree("b0_cat") == 3


def _exhaustive(g, stages, **options):
    """min bottleneck over every op -> stage map that evaluate accepts (no pruning, no shared code path)."""
    names = list(g.nx)
    best = None
    for stages_of in itertools.product(range(stages), repeat=len(names)):
        try:
            part = evaluate(g, dict(zip(names, stages_of)), stages=stages, **options)
        except InvalidAssignmentError:
            continue
        if part.memory_ok and (best is None or part.bottleneck < best):
            best = part.bottleneck
    return best


@pytest.mark.parametrize("seed", [4, 5])
def test_brute_force_is_the_minimum(seed):
    g = synthetic.random_dag(6, seed=seed)
    cluster = Cluster.uniform(3, bandwidth=1e10, latency=1e-5)
    best = synthetic.brute_force(g, 3, cluster=cluster)
    assert best.optimal and best.gap == 0
    assert best.bottleneck == pytest.approx(_exhaustive(g, 3, cluster=cluster), rel=1e-12)
    # over one order: every placement of two cuts, costed one by one
    order = g.topological_order()
    cuts = [evaluate(g, {v: (i >= a) + (i >= b) for i, v in enumerate(order)}, cluster=cluster, stages=3).bottleneck
            for a, b in itertools.combinations(range(1, len(order)), 2)]
    ordered = synthetic.brute_force(g, 3, cluster=cluster, order=order)
    assert ordered.bottleneck == pytest.approx(min(cuts), rel=1e-12)


def test_brute_force_honours_memory_and_overlapping_groups():
    g = synthetic.random_dag(6, seed=2, edge_prob=0.2)  # n0 -> n1 -> n2 -> n3, n0 -> n4, n1 -> n5
    limit = 50e6  # the group n2, n4, n5 needs 48.2 MB: it fits beside n3 (0.9 MB), not beside n1 (2.6 MB)
    groups = [["n2", "n4"], ["n4", "n5"]]  # one group of three through n4
    # (sizes counted without the optimizer step's workspace, which would double these parameters' share)
    best = synthetic.brute_force(g, 3, memory_limit=limit, colocate=groups, workspace_factor=0.0)
    assert best.stage_of["n2"] == best.stage_of["n4"] == best.stage_of["n5"] and best.memory_ok
    exhaustive = [evaluate(g, dict(zip(g.nx, s)), stages=3, memory_limit=limit, workspace_factor=0.0)
                  for s in itertools.product(range(3), repeat=6) if s[2] == s[4] == s[5]
                  and _is_pipeline(g, dict(zip(g.nx, s)))]
    assert best.bottleneck == pytest.approx(min(p.bottleneck for p in exhaustive if p.memory_ok), rel=1e-12)


def _is_pipeline(g, stage_of):
    return len(set(stage_of.values())) == 3 and all(stage_of[u] <= stage_of[v] for u, v in g.nx.edges)


def test_assertions():
    g = synthetic.chain(4)
    good = evaluate(g, {"op0": 0, "op1": 0, "op2": 1, "op3": 1})
    synthetic.assert_valid(g, good)
    half = evaluate(g, {"op0": 0, "op1": 0, "op2": 1, "op3": 1})
    half.lower_bound = half.bottleneck / 2  # a bound set by hand: within 2x, not within 1.5x
    synthetic.assert_within_bound(half, 2.0)
    with pytest.raises(AssertionError, match="more than 1.5"):
        synthetic.assert_within_bound(half, 1.5)
    synthetic.assert_near(good, good.bottleneck)
    with pytest.raises(AssertionError):
        synthetic.assert_near(good, good.bottleneck / 2)
    with pytest.raises(AssertionError, match="split"):
        synthetic.assert_valid(g, good, colocate=[["op0", "op3"]])
    tampered = evaluate(g, {"op0": 0, "op1": 0, "op2": 1, "op3": 1})
    tampered.stages[0].time = 0.0
    assert synthetic.check_partition(g, tampered)


def test_check_partition_weighs_memory_under_the_plans_cap_on_microbatches_in_flight():
    """A GPipe plan that fits only because it holds one microbatch at a time: checked without its
    ``active_microbatches`` it was reported over the memory limit."""
    g = synthetic.generate("chain", 12, seed=0)
    options = dict(microbatches=8, schedule="gpipe", recompute="none")
    stage_of = {v: (0 if i < 6 else 1) for i, v in enumerate(nx.topological_sort(g.nx))}
    capped = evaluate(g, stage_of, active_microbatches=1, **options)
    limit = max(s.memory for s in capped.stages) * 1.001
    assert not evaluate(g, stage_of, memory_limit=limit, **options).memory_ok  # all 8 in flight do not fit
    part = evaluate(g, stage_of, memory_limit=limit, active_microbatches=1, **options)
    assert part.memory_ok
    assert synthetic.check_partition(g, part) == []
