"""Synthetic costed op graphs, a brute-force oracle, and assertions on cut quality for tests.

Every generator takes a ``seed`` and returns an :class:`~partitioner.graph.OpGraph`
whose nodes carry ``fwd``, ``bwd``, ``bwd_w`` (seconds), ``params``, ``out_bytes``
(bytes), ``module`` and ``index``; costs are heterogeneous (random multipliers on a
FLOP-derived base). Use them in your own tests::

    from partitioner import solve, synthetic
    g = synthetic.unet(3, seed=1)
    best = synthetic.brute_force(g, 3)          # only for small graphs
    synthetic.assert_near(solve(g, 3), best)    # equal to the oracle
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import networkx as nx

from partitioner.cost import Partition, evaluate, partition
from partitioner.errors import MemoryLimitError
from partitioner.graph import OpGraph
from partitioner.problem import Problem, ProblemSettings

__all__ = [
    "chain", "random_dag", "layered_dag", "transformer", "unet", "encoder_decoder", "inception",
    "generate", "SUITES", "brute_force", "check_partition", "assert_valid", "assert_near",
    "assert_within_bound",
]

#: Seconds per FLOP of the imaginary device the generators cost ops for (~100 TFLOP/s).
_SEC_PER_FLOP = 1e-14
_BYTES = 2  # bf16 activations and parameters


class _Builder:
    """Adds nodes in program order with heterogeneous costs."""

    def __init__(self, seed: int, jitter: float = 0.5):
        self.rng = random.Random(seed)
        self.g = nx.DiGraph()
        self.jitter = jitter

    def _j(self) -> float:
        return math.exp(self.rng.uniform(-self.jitter, self.jitter))

    def add(self, name: str, inputs: Iterable[str], *, flops: float, params: float = 0.0,
            out_bytes: float = 0.0, module: str = "", op: str = "op") -> str:
        fwd = flops * _SEC_PER_FLOP * self._j()
        bwd = fwd * self.rng.uniform(1.5, 2.5) if flops else 0.0
        self.g.add_node(name, fwd=fwd, bwd=bwd, bwd_w=bwd * 0.5 if params else 0.0,
                        params=int(params), out_bytes=int(out_bytes * self._j()), module=module,
                        op=op, index=self.g.number_of_nodes(), flops=int(flops))
        for i in inputs:
            self.g.add_edge(i, name)
        return name

    def done(self, **meta) -> OpGraph:
        return OpGraph(self.g, {"synthetic": True, **meta})


def chain(n: int, *, seed: int = 0, jitter: float = 1.0) -> OpGraph:
    """``n`` ops in a line, like an ``nn.Sequential`` of uneven layers."""
    b = _Builder(seed, jitter)
    prev: list[str] = []
    for i in range(n):
        width = b.rng.choice([256, 512, 1024, 2048])
        prev = [b.add(f"op{i}", prev, flops=2 * 2048 * width * width, params=width * width * _BYTES,
                      out_bytes=2048 * width * _BYTES, module=f"layers.{i}", op="linear")]
    return b.done(generator="chain", n=n, seed=seed)


def random_dag(n: int, *, edge_prob: float = 0.3, seed: int = 0, jitter: float = 1.0) -> OpGraph:
    """A random DAG on ``n`` ops: edge i -> j (i < j) with probability ``edge_prob``.

    Every op but the first gets at least one input, so the graph is connected and has
    no spurious extra sources.
    """
    b = _Builder(seed, jitter)
    names: list[str] = []
    for i in range(n):
        inputs = [names[j] for j in range(i) if b.rng.random() < edge_prob]
        if i and not inputs:
            inputs = [names[b.rng.randrange(i)]]
        width = b.rng.choice([128, 256, 512, 1024])
        names.append(b.add(f"n{i}", inputs, flops=2 * 1024 * width * width,
                           params=width * width * _BYTES * b.rng.choice([0, 1, 1, 4]),
                           out_bytes=1024 * width * _BYTES, module=f"blocks.{i}", op="op"))
    return b.done(generator="random_dag", n=n, seed=seed)


def layered_dag(n: int, *, width: int = 4, edge_prob: float = 0.3, skip_prob: float = 0.05,
                seed: int = 0, jitter: float = 1.0) -> OpGraph:
    """About ``n`` ops in layers of up to ``width``; edges between adjacent layers, skips up to 8 layers back."""
    b = _Builder(seed, jitter)
    layers: list[list[str]] = []
    made = 0
    while made < n:
        w = min(b.rng.randint(1, width), n - made)
        layer = []
        for k in range(w):
            inputs: list[str] = []
            if layers:
                prev = layers[-1]
                inputs = [x for x in prev if b.rng.random() < edge_prob] or [b.rng.choice(prev)]
                # Skips reach back a few layers only, as residual/dense blocks do.
                for older in layers[-9:-1]:
                    inputs += [x for x in older if b.rng.random() < skip_prob]
            ch = b.rng.choice([256, 512, 1024])
            layer.append(b.add(f"l{len(layers)}_{k}", inputs, flops=2 * 2048 * ch * ch,
                               params=ch * ch * _BYTES, out_bytes=2048 * ch * _BYTES,
                               module=f"layers.{len(layers)}.op{k}", op="op"))
            made += 1
        layers.append(layer)
    return b.done(generator="layered_dag", n=n, seed=seed)


def transformer(layers: int, *, d_model: int = 1024, vocab: int = 50_304, tokens: int = 4096,
                seq: int = 1024, seed: int = 0, jitter: float = 0.15) -> OpGraph:
    """A GPT-like decoder: a big embedding, ``layers`` blocks on a residual stream, a big LM head.

    Each block is ln1 -> qkv -> attn -> proj -> add(residual) -> ln2 -> fc1 -> gelu -> fc2 ->
    add(residual): 10 ops, and the residual stream skips over each sub-block.
    """
    b = _Builder(seed, jitter)
    d, t = d_model, tokens
    act = t * d * _BYTES
    x = b.add("embed", [], flops=t * d, params=vocab * d * _BYTES, out_bytes=act, module="embed",
              op="embedding")
    for i in range(layers):
        m = f"layers.{i}"
        ln1 = b.add(f"l{i}_ln1", [x], flops=5 * t * d, params=2 * d * _BYTES, out_bytes=act,
                    module=f"{m}.ln1", op="layer_norm")
        qkv = b.add(f"l{i}_qkv", [ln1], flops=2 * t * d * 3 * d, params=3 * d * d * _BYTES,
                    out_bytes=3 * act, module=f"{m}.attn.qkv", op="linear")
        att = b.add(f"l{i}_attn", [qkv], flops=4 * t * seq * d, out_bytes=act,
                    module=f"{m}.attn", op="sdpa")
        proj = b.add(f"l{i}_proj", [att], flops=2 * t * d * d, params=d * d * _BYTES, out_bytes=act,
                     module=f"{m}.attn.proj", op="linear")
        add1 = b.add(f"l{i}_add1", [x, proj], flops=t * d, out_bytes=act, module=m, op="add")
        ln2 = b.add(f"l{i}_ln2", [add1], flops=5 * t * d, params=2 * d * _BYTES, out_bytes=act,
                    module=f"{m}.ln2", op="layer_norm")
        fc1 = b.add(f"l{i}_fc1", [ln2], flops=8 * t * d * d, params=4 * d * d * _BYTES,
                    out_bytes=4 * act, module=f"{m}.mlp.fc1", op="linear")
        gelu = b.add(f"l{i}_gelu", [fc1], flops=8 * t * d, out_bytes=4 * act, module=f"{m}.mlp.act",
                     op="gelu")
        fc2 = b.add(f"l{i}_fc2", [gelu], flops=8 * t * d * d, params=4 * d * d * _BYTES,
                    out_bytes=act, module=f"{m}.mlp.fc2", op="linear")
        x = b.add(f"l{i}_add2", [add1, fc2], flops=t * d, out_bytes=act, module=m, op="add")
    lnf = b.add("ln_f", [x], flops=5 * t * d, params=2 * d * _BYTES, out_bytes=act, module="ln_f",
                op="layer_norm")
    head = b.add("head", [lnf], flops=2 * t * d * vocab, params=vocab * d * _BYTES,
                 out_bytes=t * vocab * _BYTES, module="head", op="linear")
    b.add("loss", [head], flops=3 * t * vocab, out_bytes=4, module="", op="cross_entropy")
    return b.done(generator="transformer", layers=layers, seed=seed)


def unet(depth: int, *, blocks: int = 2, channels: int = 64, size: int = 256, batch: int = 8,
         seed: int = 0, jitter: float = 0.15) -> OpGraph:
    """A U-Net: ``depth`` levels down, a bottleneck, ``depth`` levels up, long skips across.

    High-resolution levels have cheap compute relative to their huge activations, so the
    skip tensors that cross a cut are expensive: the case contiguous order-blind cuts miss.
    """
    b = _Builder(seed, jitter)
    skips = []
    x: list[str] = []
    c, s = channels, size

    def conv(name: str, inputs: list[str], cin: int, cout: int, hw: int, module: str) -> list[str]:
        return [b.add(name, inputs, flops=2 * batch * hw * hw * cin * cout * 9,
                      params=cin * cout * 9 * _BYTES, out_bytes=batch * hw * hw * cout * _BYTES,
                      module=module, op="conv2d")]

    cin = 3
    for lv in range(depth):
        for k in range(blocks):
            x = conv(f"down{lv}_conv{k}", x, cin, c, s, f"down.{lv}.conv{k}")
            cin = c
        skips.append((x[0], c, s))
        x = [b.add(f"down{lv}_pool", x, flops=batch * s * s * c, out_bytes=batch * (s // 2) ** 2 * c * _BYTES,
                   module=f"down.{lv}.pool", op="max_pool2d")]
        c, s = c * 2, s // 2
    for k in range(blocks):
        x = conv(f"mid_conv{k}", x, cin, c, s, f"mid.conv{k}")
        cin = c
    for lv in reversed(range(depth)):
        skip, sc, ss = skips[lv]
        c, s = c // 2, s * 2
        up = b.add(f"up{lv}_up", x, flops=2 * batch * s * s * cin * c, params=cin * c * 4 * _BYTES,
                   out_bytes=batch * s * s * c * _BYTES, module=f"up.{lv}.up", op="conv_transpose2d")
        cat = b.add(f"up{lv}_cat", [up, skip], flops=0, out_bytes=batch * s * s * 2 * c * _BYTES,
                    module=f"up.{lv}", op="cat")
        x, cin = [cat], 2 * c
        for k in range(blocks):
            x = conv(f"up{lv}_conv{k}", x, cin, c, s, f"up.{lv}.conv{k}")
            cin = c
    b.add("out", x, flops=2 * batch * s * s * c, params=c * _BYTES, out_bytes=batch * s * s * _BYTES,
          module="out", op="conv2d")
    return b.done(generator="unet", depth=depth, seed=seed)


def encoder_decoder(enc_layers: int, dec_layers: int, *, d_model: int = 768, tokens: int = 4096,
                    seq: int = 512, vocab: int = 32_128, seed: int = 0, jitter: float = 0.15) -> OpGraph:
    """A T5-like model: encoder layers, then decoder layers whose cross-attention reads the encoder output."""
    b = _Builder(seed, jitter)
    d, t = d_model, tokens
    act = t * d * _BYTES
    x = b.add("enc_embed", [], flops=t * d, params=vocab * d * _BYTES, out_bytes=act, module="encoder.embed")
    for i in range(enc_layers):
        m = f"encoder.layers.{i}"
        att = b.add(f"e{i}_attn", [x], flops=8 * t * d * d + 4 * t * seq * d, params=4 * d * d * _BYTES,
                    out_bytes=act, module=f"{m}.attn", op="attention")
        a1 = b.add(f"e{i}_add1", [x, att], flops=t * d, out_bytes=act, module=m, op="add")
        ff = b.add(f"e{i}_ffn", [a1], flops=16 * t * d * d, params=8 * d * d * _BYTES, out_bytes=act,
                   module=f"{m}.ffn", op="mlp")
        x = b.add(f"e{i}_add2", [a1, ff], flops=t * d, out_bytes=act, module=m, op="add")
    memory = b.add("enc_norm", [x], flops=5 * t * d, params=2 * d * _BYTES, out_bytes=act,
                   module="encoder.norm", op="layer_norm")
    y = b.add("dec_embed", [], flops=t * d, params=vocab * d * _BYTES, out_bytes=act, module="decoder.embed")
    for i in range(dec_layers):
        m = f"decoder.layers.{i}"
        sa = b.add(f"d{i}_self", [y], flops=8 * t * d * d + 4 * t * seq * d, params=4 * d * d * _BYTES,
                   out_bytes=act, module=f"{m}.self_attn", op="attention")
        a1 = b.add(f"d{i}_add1", [y, sa], flops=t * d, out_bytes=act, module=m, op="add")
        ca = b.add(f"d{i}_cross", [a1, memory], flops=8 * t * d * d + 4 * t * seq * d,
                   params=4 * d * d * _BYTES, out_bytes=act, module=f"{m}.cross_attn", op="attention")
        a2 = b.add(f"d{i}_add2", [a1, ca], flops=t * d, out_bytes=act, module=m, op="add")
        ff = b.add(f"d{i}_ffn", [a2], flops=16 * t * d * d, params=8 * d * d * _BYTES, out_bytes=act,
                   module=f"{m}.ffn", op="mlp")
        y = b.add(f"d{i}_add3", [a2, ff], flops=t * d, out_bytes=act, module=m, op="add")
    head = b.add("lm_head", [y], flops=2 * t * d * vocab, params=vocab * d * _BYTES,
                 out_bytes=t * vocab * _BYTES, module="lm_head", op="linear")
    b.add("loss", [head], flops=3 * t * vocab, out_bytes=4, op="cross_entropy")
    return b.done(generator="encoder_decoder", seed=seed)


def inception(blocks: int, *, branches: int = 4, channels: int = 256, hw: int = 28, batch: int = 32,
              seed: int = 0, jitter: float = 0.4) -> OpGraph:
    """Inception-like: each block fans out into ``branches`` branches of 1-3 convs, then concatenates."""
    b = _Builder(seed, jitter)
    c = channels
    x = b.add("stem", [], flops=2 * batch * hw * hw * 3 * c * 49, params=3 * c * 49 * _BYTES,
              out_bytes=batch * hw * hw * c * _BYTES, module="stem", op="conv2d")
    for i in range(blocks):
        ends = []
        for br in range(branches):
            y = x
            for k in range(b.rng.randint(1, 3)):
                kk = b.rng.choice([1, 3, 5])
                cout = c // branches
                y = b.add(f"b{i}_br{br}_{k}", [y], flops=2 * batch * hw * hw * c * cout * kk * kk,
                          params=c * cout * kk * kk * _BYTES, out_bytes=batch * hw * hw * cout * _BYTES,
                          module=f"blocks.{i}.branch{br}.{k}", op="conv2d")
            ends.append(y)
        x = b.add(f"b{i}_cat", ends, flops=0, out_bytes=batch * hw * hw * c * _BYTES,
                  module=f"blocks.{i}", op="cat")
    b.add("head", [x], flops=2 * batch * c * 1000, params=c * 1000 * _BYTES, out_bytes=batch * 1000 * 4,
          module="fc", op="linear")
    return b.done(generator="inception", blocks=blocks, seed=seed)


def _unet_for(ops: int, seed: int) -> OpGraph:
    depth = 2 if ops < 40 else 4
    blocks = max(1, round((ops - 1 - 3 * depth) / (2 * depth + 1)))
    return unet(depth, blocks=blocks, seed=seed)


#: Suite name -> function(approximate op count, seed) -> OpGraph, for benchmarks.
SUITES = {
    "chain": lambda ops, seed: chain(ops, seed=seed),
    "layered": lambda ops, seed: layered_dag(ops, seed=seed),
    "transformer": lambda ops, seed: transformer(max(1, (ops - 4) // 10), seed=seed),
    "unet": lambda ops, seed: _unet_for(ops, seed),
    "encdec": lambda ops, seed: encoder_decoder(max(1, ops // 10), max(1, ops // 12), seed=seed),
    "inception": lambda ops, seed: inception(max(1, ops // 9), seed=seed),
}


def generate(kind: str, ops: int, seed: int = 0) -> OpGraph:
    """A graph of the given suite with about ``ops`` ops (see :data:`SUITES`)."""
    if kind not in SUITES:
        raise ValueError(f"unknown synthetic suite {kind!r}; one of {', '.join(SUITES)}")
    return SUITES[kind](ops, seed)


# ---------------------------------------------------------------------- the oracle


def brute_force(graph: OpGraph | nx.DiGraph, stages: int | ProblemSettings, *,
                colocate: Iterable[Iterable[Hashable]] = (), order: Sequence[Hashable] | None = None,
                **options: Any) -> Partition:
    """The true optimum by exhaustive enumeration (small graphs only: it is exponential).

    Enumerates every valid assignment (each op on a stage no earlier than its inputs',
    every stage holding an op other than the model's output node, colocation groups together), or, with ``order``, every
    placement of contiguous cuts in that order; and for each, every combination of the
    stages' allowed recomputation choices (``recompute``, "auto" by default, as in ``solve``: ``stages`` and
    ``options`` are solve's), keeping the
    fastest that fits memory. Partial assignments are abandoned once some stage already
    costs at least the best found, or needs more memory than the limit under every choice
    (costs only grow as ops are added), which keeps it exact. Raises MemoryLimitError when
    nothing fits.
    """
    if not isinstance(stages, ProblemSettings):
        options.setdefault("recompute", "auto")  # as solve chooses it
    prob = Problem(graph, stages, order=order, **options)
    n, p, k = prob.n, prob.p, prob.directions
    group_of = _group_ids(prob, colocate)
    lim = [math.inf if x is None else x * (1 + 1e-12) for x in prob.mem_limit]
    best_val, best, best_choices = math.inf, None, None

    def offer(assign: list[int]) -> None:
        """Every combination of the stages' choices, priced with the choices given (not picked)."""
        nonlocal best_val, best, best_choices
        for combo in itertools.product(*prob.choices):
            t, mem = prob.stage_costs(assign, list(combo))
            if all(m <= lm for m, lm in zip(mem, lim)) and max(t) < best_val:
                best_val, best, best_choices = max(t), list(assign), list(combo)

    real = [0 if out else 1 for out in prob.is_output]  # a stage of nothing but the output node is empty
    if order is not None:
        for cuts in itertools.combinations(range(1, n), p - 1):
            bounds = [0, *cuts, n]
            assign = [s for s in range(p) for _ in range(bounds[s], bounds[s + 1])]
            if any(len({assign[i] for i in group_of if group_of[i] == g}) > 1 for g in set(group_of.values())):
                continue
            if not all(sum(real[bounds[s]:bounds[s + 1]]) for s in range(p)):
                continue
            offer(assign)
    else:
        assign = [-1] * n
        load = [0.0] * p
        mem = [dict.fromkeys(prob.choices[s], 0.0) for s in range(p)]  # per stage, per allowed choice
        used = [0] * p
        sent: set[tuple[int, int]] = set()
        group_stage: dict[int, int] = {}

        def rec(v: int) -> None:
            if v == n:
                if all(used) and max(load) < best_val:
                    offer(assign)
                return
            if sum(1 for s in range(p) if not used[s]) > n - v:
                return
            lo = max((assign[u] for u in prob.pred[v]), default=0)
            choices = range(lo, p)
            g = group_of.get(v)
            if g is not None and g in group_stage:
                choices = [group_stage[g]] if group_stage[g] >= lo else []
            for s in choices:
                added = []
                assign[v] = s
                load[s] += prob.work[v] / prob.speed[s]
                for c in mem[s]:
                    mem[s][c] += prob.node_memory(v, s, c)
                used[s] += real[v]
                for u in prob.pred[v]:
                    a = assign[u]
                    if a != s and prob.out_bytes[u] > 0 and (u, s) not in sent:
                        c = k * prob.transfer_seconds(a, s, prob.out_bytes[u])
                        sent.add((u, s))
                        load[a] += c
                        load[s] += c
                        added.append((u, a, c))
                new_group = g is not None and g not in group_stage
                if new_group:
                    group_stage[g] = s
                if min(mem[s].values()) <= lim[s] and max(load) < best_val:
                    rec(v + 1)
                if new_group:
                    del group_stage[g]
                for u, a, c in added:
                    sent.discard((u, s))
                    load[a] -= c
                    load[s] -= c
                used[s] -= real[v]
                for c in mem[s]:
                    mem[s][c] -= prob.node_memory(v, s, c)
                load[s] -= prob.work[v] / prob.speed[s]
                assign[v] = -1

        rec(0)
    if best is None:
        raise MemoryLimitError("brute force: no valid assignment fits the memory limit", needed=None)
    part = partition(prob, best, method="brute_force" if order is None else "brute_force(order)",
                     choices=best_choices)
    if order is None:
        part.with_report(lower_bound=part.bottleneck, optimal=True)
    return part


def _group_ids(prob: Problem, colocate: Iterable[Iterable[Hashable]]) -> dict[int, int]:
    """Group id per position of a colocated op; groups sharing an op are one group."""
    group_of: dict[int, int] = {}
    for gi, group in enumerate(colocate):
        members = [prob.pos[name] for name in group]
        joined = {group_of[m] for m in members if m in group_of}
        for pos, g in list(group_of.items()):
            if g in joined:
                group_of[pos] = gi
        for m in members:
            group_of[m] = gi
    return group_of


# ---------------------------------------------------------------------- assertions


def check_partition(graph: OpGraph | nx.DiGraph, part: Partition, *,
                    colocate: Iterable[Iterable[Hashable]] = (), memory: bool = True,
                    ranks: int | None = None) -> list[str]:
    """Everything wrong with ``part`` for ``graph`` (an empty list when it is a valid plan).

    Checks that every op has a stage, stages are non-empty, edges never flow backward,
    colocation groups share a stage, memory fits (when ``memory``), the lower bound does
    not exceed the bottleneck, and the reported stage times match a fresh evaluation
    (under the stages' own recomputation choices and the plan's cap on microbatches in
    flight). ``ranks``: the pipeline ranks of an interleaved plan, which a Partition does
    not record (its memory depends on them).
    """
    problems = []
    try:
        fresh = evaluate(graph, part.stage_of, part.settings(ranks))
    except ValueError as err:
        return [str(err)]
    for a, b in zip(fresh.stages, part.stages):
        if not math.isclose(a.time, b.time, rel_tol=1e-9, abs_tol=1e-15):
            problems.append(f"stage {a.index}: reported time {b.time} but the cost model says {a.time}")
    for group in colocate:
        stages_used = {part.stage_of[m] for m in group}
        if len(stages_used) > 1:
            problems.append(f"colocation group {list(group)[:4]} is split over stages {sorted(stages_used)}")
    if memory and not fresh.memory_ok:
        problems.append("memory limit exceeded on stages "
                        f"{[s.index for s in fresh.stages if not s.fits]}")
    if part.lower_bound > part.bottleneck * (1 + 1e-9):
        problems.append(f"lower bound {part.lower_bound} exceeds the bottleneck {part.bottleneck}")
    return problems


def assert_valid(graph: OpGraph | nx.DiGraph, part: Partition, **kwargs) -> None:
    """Raise AssertionError listing :func:`check_partition`'s findings, if any."""
    problems = check_partition(graph, part, **kwargs)
    assert not problems, "invalid partition: " + "; ".join(problems)


def assert_near(part: Partition, reference: Partition | float, *, ratio: float = 1.0,
                rel: float = 1e-6) -> None:
    """Assert ``part``'s bottleneck is at most ``ratio`` x the reference's (an oracle's Partition or a number)."""
    ref = reference.bottleneck if isinstance(reference, Partition) else float(reference)
    assert part.bottleneck <= ref * ratio * (1 + rel) + 1e-15, (
        f"{part.method}: bottleneck {part.bottleneck:.6g} > {ratio} x reference {ref:.6g} "
        f"(ratio {part.bottleneck / ref if ref else math.inf:.4f})")


def assert_within_bound(part: Partition, ratio: float) -> None:
    """Assert the bottleneck is within ``ratio`` of the partition's own proven lower bound."""
    assert part.bottleneck <= part.lower_bound * ratio * (1 + 1e-12), (
        f"{part.method}: bottleneck {part.bottleneck:.6g} is {part.ratio:.4f}x its lower bound "
        f"{part.lower_bound:.6g}, more than {ratio}")
