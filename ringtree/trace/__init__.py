"""Reading a training run's profiler traces (Kineto's Chrome-trace JSON, one file per rank) and
saying where its time goes: pure Python and numpy, no torch, so it starts fast and runs anywhere."""
