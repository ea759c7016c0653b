"""The synthetic-graph kit: generators are seeded DAGs with costs; the oracle and assertions work."""

import networkx as nx
import pytest

from partitioner import synthetic
from partitioner.cost import evaluate


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


def test_brute_force_is_the_minimum():
    g = synthetic.random_dag(6, seed=4)
    best = synthetic.brute_force(g, 3)
    assert best.optimal and best.gap == 0
    # every contiguous cut of the program order is one of the enumerated assignments
    ordered = synthetic.brute_force(g, 3, order=g.topological_order())
    assert ordered.bottleneck >= best.bottleneck
    synthetic.assert_near(ordered, best, ratio=ordered.bottleneck / best.bottleneck)


def test_assertions():
    g = synthetic.chain(4)
    good = evaluate(g, {"op0": 0, "op1": 0, "op2": 1, "op3": 1})
    synthetic.assert_valid(g, good)
    synthetic.assert_within_bound(good, good.ratio)
    with pytest.raises(AssertionError):
        synthetic.assert_near(good, good.bottleneck / 2)
    with pytest.raises(AssertionError, match="split"):
        synthetic.assert_valid(g, good, colocate=[["op0", "op3"]])
    tampered = evaluate(g, {"op0": 0, "op1": 0, "op2": 1, "op3": 1})
    tampered.stages[0].time = 0.0
    assert synthetic.check_partition(g, tampered)
