"""OpGraph: totals, JSON round-trip, coarsening."""

import json

import networkx as nx
import pytest

from partitioner.graph import OpGraph


def _diamond() -> OpGraph:
    g = nx.DiGraph()
    for i, (name, module) in enumerate([("a", "emb"), ("b", "layers.0.attn"), ("c", "layers.0.mlp"),
                                        ("v", "layers.0"), ("d", "layers.1.attn"), ("e", "head")]):
        g.add_node(name, fwd=0.0 if name == "v" else 1.0 + i, bwd=0.0 if name == "v" else 2.0 * (1 + i),
                   params=0 if name == "v" else 10 * i, out_bytes=100 + i, module=module, op="x", index=i)
    g.add_edges_from([("a", "b"), ("a", "c"), ("b", "v"), ("c", "v"), ("v", "d"), ("d", "e")])
    return OpGraph(g, {"model": "toy"})


def test_totals_and_defaults():
    graph = _diamond()
    assert graph.total_fwd == pytest.approx(1 + 2 + 3 + 5 + 6)
    assert graph.total_bwd == pytest.approx(2 * graph.total_fwd)
    assert graph.total_params == 10 * (1 + 2 + 4 + 5)
    assert graph["a"]["fx_nodes"] == ("a",)
    assert graph["a"]["shared_params"] == ()
    assert graph.topological_order() == ["a", "b", "c", "v", "d", "e"]
    assert not graph.is_chain()
    assert [n for n, _ in graph.heaviest(2)] == ["e", "d"]


def test_json_round_trip_is_lossless(tmp_path):
    graph = _diamond()
    text = graph.to_json(tmp_path / "g.json")
    again = OpGraph.from_json(tmp_path / "g.json")
    assert again == graph
    assert OpGraph.from_json(text).to_dict() == graph.to_dict()
    assert set(again.nx.edges) == set(graph.nx.edges)


def test_json_errors(tmp_path):
    with pytest.raises(ValueError, match="not an smp op graph"):
        OpGraph.from_json('{"nodes": []}')
    with pytest.raises(ValueError, match="newer than this smp"):
        OpGraph.from_json(json.dumps({"kind": "smp.OpGraph", "schema": 99, "nodes": [], "edges": []}))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        OpGraph.from_json(bad)
    with pytest.raises(FileNotFoundError):
        OpGraph.from_json(tmp_path / "missing.json")


def test_cycle_is_refused():
    g = nx.DiGraph([("a", "b"), ("b", "a")])
    with pytest.raises(ValueError, match="acyclic"):
        OpGraph(g)


def test_coarsen_by_module_depth_keeps_costs_and_mapping():
    graph = _diamond()
    coarse = graph.coarsen(depth=2, fold_free=True)
    assert nx.is_directed_acyclic_graph(coarse.nx)
    assert coarse.total_fwd == pytest.approx(graph.total_fwd)
    assert coarse.total_bwd == pytest.approx(graph.total_bwd)
    assert coarse.total_params == graph.total_params
    members = [f for n in coarse.nx for f in coarse[n]["fx_nodes"]]
    assert sorted(members) == sorted(graph.nx.nodes)  # every fx node in exactly one group
    # layers.0.attn, layers.0.mlp and the free view merge into "layers.0".
    group = next(n for n in coarse.nx if "b" in coarse[n]["fx_nodes"])
    assert set(coarse[group]["fx_nodes"]) == {"b", "c", "v"}
    assert coarse[group]["module"] == "layers.0"
    assert len(coarse) == 4


def test_coarsen_never_creates_cycles():
    # a -> x -> b and a -> b: merging a and b (same module) would swallow x's path.
    g = nx.DiGraph()
    g.add_node("a", fwd=1.0, module="m", index=0)
    g.add_node("x", fwd=1.0, module="other", index=1)
    g.add_node("b", fwd=1.0, module="m", index=2)
    g.add_edges_from([("a", "x"), ("x", "b"), ("a", "b")])
    coarse = OpGraph(g).coarsen(depth=1, fold_free=False)
    assert nx.is_directed_acyclic_graph(coarse.nx)
    assert len(coarse) == 3


def test_contract_rejects_non_convex_groups():
    g = nx.DiGraph([("a", "x"), ("x", "b")])
    graph = OpGraph(g)
    with pytest.raises(ValueError, match="convex"):
        graph.contract({"a": "g", "b": "g", "x": "x"})


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _random_dags(draw):
    n = draw(st.integers(2, 14))
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(f"n{i}", fwd=draw(st.sampled_from([0.0, 1.0, 2.5])), bwd=draw(st.sampled_from([0.0, 1.0])),
                   params=draw(st.sampled_from([0, 8])), out_bytes=draw(st.integers(0, 64)),
                   module=draw(st.sampled_from(["", "a.0", "a.0.x", "a.1", "b"])), index=i)
    for j in range(1, n):
        for i in draw(st.sets(st.integers(0, j - 1), max_size=3)):
            g.add_edge(f"n{i}", f"n{j}")
    return OpGraph(g)


@settings(max_examples=80, deadline=None)
@given(_random_dags(), st.sampled_from([None, 1, 2]), st.booleans(), st.booleans())
def test_coarsen_property(graph, depth, fold_free, fold_chains):
    coarse = graph.coarsen(depth=depth, fold_free=fold_free, fold_chains=fold_chains)
    assert nx.is_directed_acyclic_graph(coarse.nx)
    assert coarse.total_fwd == pytest.approx(graph.total_fwd)
    assert coarse.total_params == graph.total_params
    members = sorted(f for n in coarse.nx for f in coarse[n]["fx_nodes"])
    assert members == sorted(graph.nx.nodes)
    group = {f: n for n in coarse.nx for f in coarse[n]["fx_nodes"]}
    for u, v in graph.nx.edges:  # every dependency survives, between or inside groups
        assert group[u] == group[v] or coarse.nx.has_edge(group[u], group[v])
