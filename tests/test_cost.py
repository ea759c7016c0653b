"""The cost model, checked by hand on small graphs."""

import json
from typing import Any

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.cluster import Cluster
from partitioner.cost import Partition, evaluate, module_range
from partitioner.errors import InvalidAssignmentError, PlanningError
from partitioner.graph import OpGraph


def diamond() -> nx.DiGraph:
    """a -> b -> d, a -> c -> d; a's output is read by b and c."""
    g = nx.DiGraph()
    g.add_node("a", fwd=1.0, bwd=2.0, params=100, out_bytes=1000, module="layers.0")
    g.add_node("b", fwd=2.0, bwd=4.0, params=0, out_bytes=500, module="layers.1")
    g.add_node("c", fwd=3.0, bwd=6.0, params=10, out_bytes=500, buffers=7, module="layers.2")
    g.add_node("d", fwd=1.0, bwd=1.0, params=0, out_bytes=8, module="head")
    g.add_edges_from([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    return g


def test_stage_times_and_transfers_training():
    c = Cluster.uniform(3, bandwidth=1000.0, latency=0.5)
    part = evaluate(diamond(), {"a": 0, "b": 1, "c": 2, "d": 2}, cluster=c, microbatches=4)
    s0, s1, s2 = part.stages
    # a's output goes once to stage 1 and once to stage 2: 1000 B / 1000 B/s + 0.5 s = 1.5 s each
    # way, and its gradient comes back the same way (x2 when training).
    assert [(t.src_stage, t.dst_stage, t.node, t.bytes) for t in part.transfers] == [
        (0, 1, "a", 1000.0), (0, 2, "a", 1000.0), (1, 2, "b", 500.0)]
    assert part.transfers[0].seconds == pytest.approx(1.5)
    assert s0.compute == 3.0 and s0.comm_out_time == pytest.approx(2 * 1.5 * 2)
    assert s0.comm_in_time == 0 and s0.comm_out_bytes == 2000
    assert s1.compute == 6.0 and s1.comm_in_time == pytest.approx(3.0)
    assert s1.comm_out_time == pytest.approx(2 * (0.5 + 0.5))
    assert s2.compute == 11.0 and s2.comm_in_bytes == 1500
    assert s2.comm_in_time == pytest.approx(3.0 + 2.0)
    assert s2.time == pytest.approx(16.0)
    assert part.bottleneck == pytest.approx(16.0) and part.bottleneck_stage == 2
    # 1F1B: stage s holds min(m, p - s) microbatches; params x 4 (weights, grads, Adam).
    assert [s.in_flight for s in part.stages] == [3, 2, 1]
    assert s0.memory == 100 * 4 + 3 * 1000
    assert s2.memory == 10 * 4 + 7 + 1 * (500 + 8)
    assert s1.ops == ["b"] and s2.ops == ["c", "d"]
    assert part.lower_bound <= part.bottleneck


def test_inference_gpipe_speed_and_memory():
    c = Cluster.heterogeneous([1.0, 2.0], bandwidths=[1000.0])
    g = diamond()
    p = evaluate(g, {"a": 0, "b": 0, "c": 1, "d": 1}, cluster=c, training=False)
    assert p.stages[1].compute == pytest.approx((3.0 + 1.0) / 2.0)
    assert p.stages[0].comm_out_time == pytest.approx(1.0 + 0.5)  # a and b, no gradient
    assert p.stages[1].memory == 10 + 7 + 508  # inference: no optimiser state, one microbatch
    gp = evaluate(g, {"a": 0, "b": 0, "c": 1, "d": 1}, cluster=c, microbatches=8, schedule="gpipe")
    assert [s.in_flight for s in gp.stages] == [8, 8]
    zb = evaluate(g, {"a": 0, "b": 0, "c": 1, "d": 1}, cluster=c, microbatches=8, schedule="zb_h1")
    # ZB-H1 defers stage i's W by i microbatches, so the last stage too holds two (read off the schedule)
    assert zb.schedule == "zb-h1" and [s.in_flight for s in zb.stages] == [2, 2]
    with pytest.raises(PlanningError, match="unknown schedule"):
        evaluate(g, {"a": 0, "b": 0, "c": 1, "d": 1}, schedule="pipedream")


def test_memory_limit_reported():
    p = evaluate(diamond(), {"a": 0, "b": 0, "c": 1, "d": 1}, memory_limit=1000)
    assert not p.memory_ok and p.stages[0].memory_limit == 1000 and p.notes
    ok = evaluate(diamond(), {"a": 0, "b": 0, "c": 1, "d": 1}, memory_limit=1e9)
    assert ok.memory_ok


def test_invalid_assignments():
    g = diamond()
    with pytest.raises(InvalidAssignmentError, match="flow backward"):
        evaluate(g, {"a": 1, "b": 0, "c": 1, "d": 1})
    with pytest.raises(InvalidAssignmentError, match="no ops"):
        evaluate(g, {"a": 0, "b": 0, "c": 2, "d": 2})
    with pytest.raises(InvalidAssignmentError, match="no stage"):
        evaluate(g, {"a": 0, "b": 0})
    with pytest.raises(PlanningError, match="cycle"):
        cyc = nx.DiGraph([("x", "y"), ("y", "x")])
        evaluate(cyc, {"x": 0, "y": 0})


def test_round_trip_json_and_opgraph():
    og = OpGraph(diamond())
    p = evaluate(og, {"a": 0, "b": 1, "c": 1, "d": 1}, cluster=Cluster.uniform(2, bandwidth=1e3))
    d = json.loads(json.dumps(p.to_dict()))
    q = Partition.from_dict(d)
    assert q.to_dict() == p.to_dict()
    assert q.stages[1].modules == "layers.1–2, head"
    assert "bottleneck" in p.table()


def test_free_cluster_and_bounds():
    p = evaluate(diamond(), {"a": 0, "b": 0, "c": 1, "d": 1})
    assert p.transfers[0].seconds == 0.0
    assert p.bottleneck == pytest.approx(max(9.0, 11.0))
    # total 20 over 2 stages = 10; pigeonhole of the 3 largest ops (9, 6, 3): 6 + 3 = 9
    assert p.lower_bound == pytest.approx(10.0)


def test_module_range():
    assert module_range(["embed", "layers.0.attn", "layers.5.mlp"]) == "embed, layers.0 (+1 op of 5)"
    assert module_range(["", "layers.3"]) == "layers.3"
    assert module_range([]) == ""
    # long lists keep every layer range, the first and last label, and mark the gap
    assert module_range(["tok_emb", "pos_emb", "drop", "blocks.0.ln1", "blocks.1.attn"]) == "tok_emb, …, blocks.0–1"
    assert module_range(["blocks.6.x", "blocks.7", "ln_f", "lm_head"]) == "blocks.6–7, ln_f, lm_head"


def _saved_graph() -> OpGraph:
    """a -> b -> c -> d: a is as costly as the rest together, its output large and saved by nobody."""
    import networkx as nx

    g = nx.DiGraph()
    for i, (name, out, work) in enumerate((("a", 1000, 3.0), ("b", 10, 1.0), ("c", 10, 1.0), ("d", 10, 1.0))):
        g.add_node(name, fwd=work, bwd=work, params=0, out_bytes=out, saved_bytes=5, storage_bytes=out,
                   index=i, module=name)
    g.add_edges_from([("a", "b"), ("b", "c"), ("c", "d")])
    return OpGraph(g, {"activations": "saved_bytes"})


def test_a_stage_keeps_what_it_receives_and_what_it_sends() -> None:
    g = _saved_graph()
    after_a = evaluate(g, {"a": 0, "b": 1, "c": 1, "d": 1}, microbatches=1)
    after_b = evaluate(g, {"a": 0, "b": 0, "c": 1, "d": 1}, microbatches=1)
    # stage 0 keeps a (sent, 1000 bytes, of which nobody saved anything) besides its own saved 5
    assert after_a.stages[0].activations == 5 + 1000
    assert after_a.stages[1].activations == 3 * 5 + 1000  # and stage 1 keeps the copy it received
    assert after_b.stages[1].activations == 2 * 5 + 10


def test_the_solver_covers_the_cut_tensors_under_a_memory_limit() -> None:
    from partitioner.solve import solve

    g = _saved_graph()
    free = solve(g, 2, microbatches=1, method="dp")
    assert free.stage_of["b"] == 1  # the balanced cut [a | b c d] sends a's 1000 bytes
    limit = 200.0
    part = solve(g, 2, microbatches=1, memory_limit=limit, method="dp")
    assert part.memory_ok and all(s.memory <= limit for s in part.stages)
    assert part.stage_of["b"] == 0  # the cut that sends b's 10 bytes, not a's 1000


def _reference_comm(prob, assign):
    """The cost model's transfers, priced one producer at a time (stage_report's loop before it was
    vectorised): per stage, the time the transfers add and the bytes it receives, and the storages
    each stage keeps for sending."""
    k = prob.directions
    t, recv, roots = [0.0] * prob.p, [0.0] * prob.p, set()
    for u, succ in enumerate(prob.succ):
        b = prob.out_bytes[u]
        if b <= 0 or not succ:
            continue
        src = assign[u]
        for dst in {assign[v] for v in succ}:
            if dst != src:
                c = k * (b / prob.bw[src, dst] + prob.lat[src, dst])
                t[src] += c
                t[dst] += c
                roots.add(u)
                recv[dst] += b
    kept = [0.0] * prob.p
    views = {}
    for u in roots:
        views.setdefault(prob.root[u], []).append(u)
    for r, us in views.items():
        if any(assign[r] == assign[u] for u in us):
            kept[assign[r]] += float(prob.rec.sent["full"][r])
    return t, recv, kept


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.integers(5, 12), st.integers(2, 5), st.randoms(use_true_random=False))
def test_vectorised_pricing_matches_the_transfer_loop(n, p, rng):
    # stage_report prices the transfers with numpy; the loop it replaced is the reference,
    # on random DAGs with views of other ops' storage, over heterogeneous links ("full"
    # recomputation: every sent storage counts, so the storages kept are compared too).
    from partitioner.problem import Problem

    g = _random_dag(rng, n, lambda: dict(fwd=rng.random() * 1e-3, out_bytes=rng.choice([0, 1e3, 1e6, 4e6])))
    cluster = Cluster.heterogeneous([rng.choice([0.5, 1.0, 2.0]) for _ in range(p)],
                                    bandwidths=[rng.choice([1e9, 1e10, 1e11]) for _ in range(p - 1)],
                                    latencies=[rng.choice([0.0, 1e-5]) for _ in range(p - 1)])
    prob = Problem(g, p, cluster=cluster, microbatches=2, training=rng.random() < 0.5)
    assign = sorted(rng.randrange(p) for _ in range(n))  # monotone in the program order: valid
    t, recv, kept = _reference_comm(prob, assign)
    report = prob.stage_report(assign, ["none"] * p)
    compute = [sum(prob.work[i] for i in range(n) if assign[i] == s) / prob.speed[s] for s in range(p)]
    sent = prob.kept_for_sending(assign, {u for u in range(n) if prob.out_bytes[u] > 0
                                          and any(assign[v] != assign[u] for v in prob.succ[u])}, ("full",))["full"]
    for s, term in enumerate(report):
        assert term.time == pytest.approx(compute[s] + t[s], rel=1e-12, abs=1e-18)
        assert sent[s] == pytest.approx(kept[s], rel=1e-12, abs=1e-9)


def _reference_report(prob, assign, choices=None):
    """stage_report's per-stage rule, one stage and one choice at a time (the loop before it was vectorised over the
    stages): among a stage's allowed choices the first that fits its memory limit, or offloading where it fits and
    is strictly faster; the one needing least memory when none fits."""
    import numpy as np

    from partitioner.problem import StageTerms
    from partitioner.recompute import OFFLOAD, check_mode

    p = prob.p
    a = np.asarray(assign, dtype=np.int64)
    options = prob.choices if choices is None else [(c,) for c in check_mode(choices, p)]
    used = {c for opts in options for c in opts}
    comp = np.bincount(a, weights=prob.work, minlength=p)
    fixed = np.bincount(a, weights=prob.fixed_mem, minlength=p)
    workspace = np.bincount(a, weights=prob.step_workspace, minlength=p)
    working = np.bincount(a, weights=prob.working, minlength=p)
    _, recv, _ = _reference_comm(prob, assign)
    edges = [(u, v) for u, succ in enumerate(prob.succ) if prob.out_bytes[u] > 0 for v in succ]
    eu, ev = np.array([u for u, _ in edges], dtype=np.int64), np.array([v for _, v in edges], dtype=np.int64)
    crossing = a[ev] != a[eu]
    pairs = np.unique(eu[crossing] * p + a[ev][crossing])
    senders, to = pairs // p, pairs % p
    frm = a[senders]
    cost = prob.directions * (prob.out_bytes[senders] / prob.bw[frm, to] + prob.lat[frm, to])
    t = comp / prob.speed + np.bincount(frm, weights=cost, minlength=p) + np.bincount(to, weights=cost, minlength=p)
    sent = prob.kept_for_sending(assign, set(senders.tolist()), used)
    out = []
    for s in range(p):
        fitting = pick = None
        for c in options[s]:
            kept = float(np.bincount(a, weights=prob.rec.kept[c], minlength=p)[s]) \
                + (recv[s] if prob.rec.received[c] else 0.0) + float(sent[c][s])
            remade = float(np.bincount(a, weights=prob.rec.remade[c], minlength=p)[s])
            memory = float(fixed[s]) + max(prob.in_flight[s] * kept + prob.recomputing[s] * remade,
                                           float(workspace[s]) - float(working[s]))
            rec_t = float(np.bincount(a, weights=prob.rec.seconds[c], minlength=p)[s]) / prob.speed[s]
            term = StageTerms(c, float(t[s] + rec_t), memory, kept, remade, rec_t,
                              float(workspace[s]), float(working[s]))
            if prob.mem_limit[s] is None or memory <= prob.mem_limit[s] * (1 + 1e-12):
                if fitting is None or c == OFFLOAD and term.time < fitting.time:
                    fitting = term
            elif pick is None or memory < pick.memory:
                pick = term
        out.append(fitting or pick)
    return out


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.integers(5, 12), st.integers(2, 5), st.sampled_from([None, 0.05, 0.15, 0.3, 0.6]), st.booleans(),
       st.randoms(use_true_random=False))
def test_each_stage_takes_the_choice_the_per_stage_rule_takes(n, p, limit, given_choices, rng):
    # stage_report weighs every stage's recomputation choices at once (numpy); the per-stage loop it replaced
    # is the reference: the same choice and the same terms on every stage, under memory limits that leave
    # some stages recomputing, some offloading (a host link) and some over the limit.
    from partitioner.problem import Problem
    from partitioner.recompute import CHOICES

    g = _random_dag(rng, n, lambda: dict(fwd=rng.random() * 1e-2, bwd=rng.random() * 2e-2,
                                         params=rng.choice([0, 1e5, 1e6]), flops=rng.choice([0, 1e9]),
                                         out_bytes=rng.choice([0, 1e6, 1e7, 4e7])))
    cluster = Cluster.load("h100-sxm", devices=p)
    total = sum(4 * d["params"] + 8 * d["out_bytes"] for _, d in g.nodes(data=True))
    prob = Problem(g, p, cluster=cluster, microbatches=4, recompute="auto",
                   memory_limit=None if limit is None else max(limit * total, 1.0))
    assign = sorted(rng.randrange(p) for _ in range(n))
    choices = [rng.choice(CHOICES) for _ in range(p)] if given_choices else None
    assert prob.stage_report(assign, choices) == _reference_report(prob, assign, choices)
    times, memory = prob.stage_costs(assign, choices)
    assert (times, memory) == ([t.time for t in _reference_report(prob, assign, choices)],
                               [t.memory for t in _reference_report(prob, assign, choices)])


def _random_dag(rng: Any, n: int, costs: Any) -> nx.DiGraph:
    """n ops in index order with ``costs()`` each, an edge from each earlier op with probability 0.35, and some ops
    views of one of their inputs' storage (the random graphs the pricing references are checked on)."""
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(f"v{i}", index=i, **costs())
        for j in range(i):
            if rng.random() < 0.35:
                g.add_edge(f"v{j}", f"v{i}")
        preds = list(g.predecessors(f"v{i}"))
        if preds and rng.random() < 0.3:
            g.nodes[f"v{i}"]["view_of"] = rng.choice(preds)
    return g
