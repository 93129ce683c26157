"""The core's traced steps (train --trace; csrc/core/step_trace.h), on the CPU backend
(host clock) and on the GPU (CUDA events, here on the emulation): every traced step's
spans arrive exactly once (with the step's result, or the drain),
tile the step in the order it runs, layer by layer, on the host's clock, and tracing
adds no host synchronisation on the GPU."""

import math

import numpy as np
import pytest

from mgpu import _core

EMULATED = bool(_core.build_info().get("gpu_emulation", False))
SIZES = [12, 40, 24, 3]
LAYERS = len(SIZES) - 1


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda":
        request.getfixturevalue("gpu")
    return request.param


def batches(steps, rows, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield (
            rng.standard_normal((rows, SIZES[0])).astype(np.float32),
            rng.standard_normal((rows, SIZES[-1])).astype(np.float32),
        )


def make_step(device, graph="off"):
    be = _core.make_backend(device, 0, 1)
    model = _core.MLP(be, SIZES, 0.0, 7)
    opt = _core.Optimizer(model, "sgd", momentum=0.9)
    # bucket_elems small enough for several buckets
    return _core.DataParallelStep(
        model, opt, _core.LocalCommunicator(), "mse", _core.StepOptions(bucket_elems=400, graph=graph)
    )


def expected_names(micro_batches: int, graph, applied: bool = True) -> list:
    """(name, micro) of a step's spans in the order the core opens them."""
    names = []
    for k in range(micro_batches):
        m = k if micro_batches > 1 else -1
        names.append(("stage", m))
        if graph:  # how the graph path ran it: "uncaptured", "graph capture + replay", "graph replay"
            # one rank, nothing to reduce: the last micro-batch's graph holds the step's tail
            tail = " + health check + optimizer" if k == micro_batches - 1 else ""
            names.append((f"forward + loss + backward{tail} ({graph})", m))
            continue
        names += [(f"forward layer {l}", m) for l in range(LAYERS)] + [("forward", m), ("loss", m)]
        names += [(f"backward layer {l}", m) for l in reversed(range(LAYERS))] + [("backward", m)]
    if graph:
        return names
    # The verdict is the backend's: a skipped update's (empty) kernel still runs, and its span says so.
    names += [
        ("allreduce wait", -1),
        ("health check", -1),
        ("optimizer" + ("" if applied else " [update skipped]"), -1),
    ]
    return names


def run(step, micro, steps, traced, x_nan_at=None):
    """Runs `steps` steps (traced when step index in `traced`): the spans the steps handed
    over, those the drain did, each step's host window on the core's clock, the results and
    when each span came (the index of the step whose result held it; `steps`: the drain)."""
    spans, windows, results, came = [], {}, [], []
    for t, (x, y) in enumerate(batches(steps, sum(micro), seed=5)):
        if t == x_nan_at:
            x = x.copy()
            x[0, 0] = np.nan
        cut = np.concatenate([[0], np.cumsum(micro)])
        before = _core.steady_seconds()
        r = step.step(
            [(x[a:b], y[a:b], int(a)) for a, b in zip(cut[:-1], cut[1:])], sum(micro), t, 1e-3, trace=t in traced
        )
        windows[t] = (before, _core.steady_seconds())
        spans += r.spans
        came += [(t, x.step) for x in r.spans]
        results.append(r)
    drained = step.drain_trace()
    came += [(steps, x.step) for x in drained]
    return spans, drained, windows, results, came


def check_tiling(step_spans, micro_batches, graph, applied=True):
    """In the order opened, the expected names; each leaf span starts where the last ended.
    graph: False, or how the graph path ran the micro-batches."""
    assert [(s.name, s.micro) for s in step_spans] == expected_names(micro_batches, graph, applied)
    leaves = [s for s in step_spans if s.name not in ("forward", "backward")]
    for a, b in zip(leaves, leaves[1:]):
        assert a.end == pytest.approx(b.begin, abs=1e-9) and a.end >= a.begin
    for s in step_spans:
        if s.name in ("forward", "backward"):  # encloses its layers exactly
            layers = [
                c
                for c in step_spans
                if c.category == "layer" and c.micro == s.micro and c.name.startswith(s.name + " ")
            ]
            assert len(layers) == LAYERS and s.category == "phase"
            assert s.begin == min(c.begin for c in layers) and s.end == max(c.end for c in layers)


@pytest.mark.parametrize("micro", [[16], [5, 11]])
def test_traced_steps_hand_over_every_span_once_tiling_the_step(device, micro):
    step = make_step(device)
    spans, drained, windows, results, came = run(step, micro, steps=4, traced={0, 1, 2})
    everything = spans + drained
    assert {s.step for s in everything} == {0, 1, 2}  # step 3 was not traced
    for t in (0, 1, 2):
        mine = [s for s in everything if s.step == t]
        check_tiling(mine, len(micro), graph=False)
        # on the host's clock, after the step began (the GPU's optimizer may end after it returned)
        assert min(s.begin for s in mine) >= windows[t][0] - 1e-6
        assert all(s.end <= windows[t][1] + 1e-6 for s in mine if s.name != "optimizer")
    if device == "cpu":  # host clock: each step's spans all come with its own result
        assert drained == [] and all(when == of for when, of in came)
    else:  # CUDA events: with its own result, or a later one (its optimizer may still run)
        assert all(when >= of for when, of in came)
    assert [len(r.buckets) for r in results] == [len(step.buckets())] * 3 + [0]


def test_a_skipped_step_says_so_in_its_optimizer_span(device):
    step = make_step(device)
    spans, drained, _, results, _ = run(step, [16], steps=2, traced={0, 1}, x_nan_at=1)
    assert results[0].applied and not results[1].applied
    check_tiling([s for s in spans + drained if s.step == 1], 1, graph=False, applied=False)


def test_a_replayed_graph_is_one_span(device):
    step = make_step(device, graph="on")
    spans, drained, *_ = run(step, [16], steps=4, traced={0, 1, 2, 3})
    assert step.uses_graphs and step.graph_replays >= 2
    # run once to size the buffers, captured at the shape's second appearance, replayed from there on
    for t, how in enumerate(["uncaptured", "graph capture + replay", "graph replay", "graph replay"]):
        check_tiling([s for s in spans + drained if s.step == t], 1, graph=how)


def test_tracing_adds_no_host_synchronisation_on_the_gpu(gpu):
    if not EMULATED:
        pytest.skip("counts host synchronisations on the emulation")
    step = make_step("cuda")
    x, y = next(batches(1, 16, seed=5))
    syncs, spans = [], []
    for t in range(6):
        before = _core.emulation.counters()["host_syncs"]
        spans += step.step([(x, y, 0)], 16, t, 1e-3, trace=t >= 3).spans
        syncs.append(_core.emulation.counters()["host_syncs"] - before)
    assert syncs[4] == syncs[5] == syncs[2] == 1
    # The step's one read-back comes after its update: every span has happened by then.
    assert step.drain_trace() == []
    check_tiling([s for s in spans if s.step == 5], 1, graph=False)
    assert all(not math.isnan(s.end) for s in spans)
