"""Device-event timing: warm-up first, then the median of many launches."""

from __future__ import annotations

import statistics


def benchmark(fn, warmup_ms: float = 100.0, rep_ms: float = 300.0, min_reps: int = 5, max_reps: int = 3000,
              state: dict | None = None) -> float:
    """Median milliseconds per call of ``fn`` (which only enqueues GPU work).

    The first call is made outside any timing (it may JIT-compile or build handles); a rough
    estimate then sizes the warm-up and the number of timed repetitions, each timed by its
    own pair of CUDA events. The repetitions span about ``rep_ms`` whatever the call's length:
    a cap of 200 left a 0.1 ms kernel 20 ms of timing, and two timings of one kernel in one run
    then differed by up to 9% on an H100 (docs/k6.md). ``state``, a dict, receives the GPU's SM
    clock, power and temperature over the timed launches (``harness.gpu_state``) where NVML answers.
    """
    est = _estimate(fn, 3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    # the warm-up's tail may still run: the same kernel
    return statistics.median(_timed_bursts(fn, 1, max(min_reps, min(max_reps, int(rep_ms / est))), state))


def burst_ms(fn, rep_ms: float = 200.0, state: dict | None = None) -> float:
    """Median milliseconds per call of ``fn`` called back to back, as a model calls it eagerly: one
    event pair around each burst of calls, nothing synchronized inside, so the slower of the host
    and the GPU sets the time. Warm-up first; bursts of at least 20 calls and about 10 ms each,
    repeated for about ``rep_ms``. ``state`` as in ``benchmark``."""
    _estimate(fn, 10)
    est = _estimate(fn, 10)  # the second burst: warm
    calls = max(20, int(10.0 / est))
    return statistics.median(_timed_bursts(fn, calls, max(5, min(200, int(rep_ms / (calls * est)))), state))


def _estimate(fn, calls: int) -> float:
    """Milliseconds per call of one burst of ``calls`` (after a first call that may compile)."""
    import torch

    fn()
    torch.cuda.synchronize()
    return max(_timed_bursts(fn, calls, 1, None)[0], 1e-3)


def _timed_bursts(fn, calls: int, bursts: int, state: dict | None) -> list:
    """Milliseconds per call of each of ``bursts`` bursts of ``calls`` back-to-back calls, an event
    pair around each; ``state`` gets the GPU's clock and power over them."""
    import time

    import torch

    from harness.gpu_state import sampler

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(bursts)]
    gpu = sampler() if state is not None else None
    t0 = time.monotonic()
    for s, e in events:
        s.record()
        for _ in range(calls):
            fn()
        e.record()
    torch.cuda.synchronize()
    if gpu:
        state.update(gpu.window(t0, time.monotonic()) or {})
    return [s.elapsed_time(e) / calls for s, e in events]


def host_us(call, n: int = 200) -> float:
    """Mean host time of ``call`` over n back-to-back calls, nothing synchronized in between."""
    import time

    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def call_us(call, n: int = 200) -> float:
    """Microseconds per call on the GPU clock: one event pair around n back-to-back calls, so the
    slower of host and kernel sets it (what a loop of eager calls sees)."""
    return _timed_bursts(call, n, 1, None)[0] * 1e3


def host_rows(calls: dict, base: dict, emit, rounds: int = 9, baseline: str | None = None) -> None:
    """One row per call (name -> call()): its host microseconds per call (``host_us``: no graph, no
    sync inside the loop) and the same calls' per-call time on the GPU clock (``call_us``: the max
    of host and kernel). The calls take turns, ``rounds`` bursts of 200 each after a warm-up, the
    order reversed every other round; each row is the median burst (a host's timing drifts by tens
    of percent from one second to the next). With ``baseline`` (a name among the calls) each row
    also gets ``vs_baseline``: the median over rounds of its burst over the baseline's burst of the
    same round, which the drift between rounds does not move. A call that raises gets a row with
    the reason."""
    host, failed = {}, {}
    for name, call in calls.items():
        try:
            for _ in range(10):  # warm-up: compiles, first allocations
                call()
            host[name] = []
        except Exception as e:
            failed[name] = failure(e)
    for i in range(rounds):
        order = list(host) if i % 2 == 0 else list(host)[::-1]
        for name in [n for n in order if n not in failed]:
            try:
                host[name].append(host_us(calls[name]))
            except Exception as e:
                failed[name] = failure(e)
    base_rounds = host.get(baseline) if baseline not in failed else None
    for name in calls:
        if name not in failed:
            try:
                per_call = call_us(calls[name])
            except Exception as e:
                failed[name] = failure(e)
        if name in failed:
            emit(dict(base, kernel=name, status=failed[name]))
        else:
            row = dict(base, kernel=name, host_us=statistics.median(host[name]), call_us=per_call, rounds=rounds,
                       host_rounds=host[name], status="ok")
            if base_rounds:
                row.update(baseline=baseline,
                           vs_baseline=statistics.median(x / y for x, y in zip(host[name], base_rounds)))
            emit(row)


def failure(e: Exception) -> str:
    """A status string for a candidate that raised: a refusal names its constraint."""
    from kernels.contract import UnsupportedProblem

    if isinstance(e, UnsupportedProblem):
        return f"refused: {e}"[:120]
    return f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:120]


def more_rounds(launches: list, first_ms: list, rounds: int, states: list | None = None,
                timers: list | None = None) -> list:
    """Each launch timed ``rounds`` times in all: ``first_ms`` is round 1, rounds 2.. run here with
    the order reversed every other round, so that none is always timed first or last while the
    GPU's clocks drift. Returns every launch's times, round 1 first. ``states``: one list per
    launch (round 1's state already in it) that each round's GPU state is appended to.
    ``timers``: one timing function per launch (``benchmark`` or ``burst_ms``), ``benchmark`` by
    default."""
    times = [[ms] for ms in first_ms]
    timers = timers or [benchmark] * len(launches)
    order = list(range(len(launches)))
    for i in range(1, rounds):
        for j in (reversed(order) if i % 2 else order):
            state = {}
            times[j].append(timers[j](launches[j], state=state if states is not None else None))
            if states is not None:
                states[j].append(state)
    return times


def gpu_fields(states: list) -> dict:
    """A row's GPU-state fields from its timings' states (one per round): the median SM clock and
    power over the rounds, the hottest temperature, every clock-lowering reason, and the clock of
    each round beside ``ms_rounds``. Empty where NVML gave nothing."""
    states = [s for s in states if s]
    if not states:
        return {}
    return dict(sm_clock_mhz=statistics.median(s["sm_clock_mhz"] for s in states),
                power_w=round(statistics.median(s["power_w"] for s in states), 1),
                temp_c=max(s["temp_c"] for s in states),
                clock_limited_by=sorted({r for s in states for r in s["clock_limited_by"]}),
                sm_clock_rounds=[s["sm_clock_mhz"] for s in states])


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def graph_ms(step, calls: int = 20, replays: int = 10) -> float:
    """Median milliseconds per call of ``step(i)`` with no host time inside: ``calls`` calls
    (i = 0..calls-1, so a caller can rotate through input copies and keep caches cold in L2) are
    captured in one CUDA graph, and each replay is timed by an event pair. For decode-sized
    kernels, where a Python call costs more than the kernel, per-call events would time the host.
    """
    import torch

    step(0)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
