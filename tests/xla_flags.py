"""XLA flags for the test processes on a CPU. The suite's time is mostly XLA compiling small programs, and LLVM at
-O0 compiles them faster: tests/test_engine.py::test_no_recompilation_after_warmup took 46 s against 79 s on 2 idle
cores. Subprocess tests that set XLA_FLAGS take theirs from `cpu`."""
CPU_OPT = "--xla_backend_optimization_level=0"


def cpu(devices: int) -> str:
    """XLA_FLAGS for a CPU test process with `devices` fake devices."""
    return f"{CPU_OPT} --xla_force_host_platform_device_count={devices}"
