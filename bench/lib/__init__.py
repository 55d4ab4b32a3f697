"""What the benchmark scripts share, so that every figure is taken and written the same way.

    timing.py       host timing: back-to-back calls closed by block_until_ready, >= 5 repeats,
                    the median and the spread
    device_time.py  device timing: the kernels' durations in a profiler trace, per call
    ceilings.py     the dense-matmul and copy-bandwidth ceilings, measured in the same run
    results.py      the stamp (device, versions, date, commit, exact command) and the result
                    files, JSON + Markdown under bench/results/
    models.py       the model configurations the engine benchmarks run (V4-Flash slices)
    engine_loop.py  steady-state decode in the engine, and its compiled step timed alone
    hlo_sources.py  a profiled kernel's model source line, from the optimised HLO
"""
