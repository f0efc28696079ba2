"""Fixed cost-model constants of virtual CPU devices, for tests that must not depend on this machine's load.

IDLE_2_CORES is what `dpkit plan --calibration` fitted to a bench of the launch-bound and wide-output examples on a
2-core machine at a quiet moment (load average about 1; benchmarks/launch_bound_prediction.py); BUSY_2_CORES the
same machine with other work on its cores (load average about 2: one core's worth left)."""

from dpkit.plan.calibration import Calibration, cpu_machine

IDLE_2_CORES = {
    "flops_per_second": 5.5e10,
    "compute_slots": 2.0,
    "copy_bytes_per_second": 6.7e9,
    "interprocess_bytes_per_second": 1e9,
    "interprocess_latency_seconds": 1e-4,
    "launch_seconds": 5.6e-6,
    "step_overhead_seconds": 1.3e-3,
    "thread_seconds": 5.7e-5,
    "module_seconds": 9.2e-6,
    "tensor_seconds": 4.7e-6,
    "gil_share": 1.6,
}
BUSY_2_CORES = {**IDLE_2_CORES, "compute_slots": 1.15, "flops_per_second": 7.3e10, "gil_share": 1.9}


def cpu_calibration(values=IDLE_2_CORES, cores=2, **changes):
    values = {**values, **changes}
    hardware, constants = cpu_machine(values, cores, "tests/plan/machines.py")
    return Calibration(hardware, constants, values, source="tests/plan/machines.py")


IN_ONE_PROCESS = ("single", "dp", "dp-balanced", "replicated")


def synthetic_bench(profile, batch_size, values=IDLE_2_CORES, strategies=IN_ONE_PROCESS):
    """A `dpkit bench --json` document whose step times are the cost model's own under `values` (a global batch
    split across 1 or 2 virtual CPU devices): what a calibration fitted to it must find again."""
    from dpkit.plan.cost_model import predict
    from dpkit.strategies import strategy_class

    hardware, constants = cpu_machine(values, 2, "synthetic")
    results = []
    for strategy in strategies:
        for devices in (1, 2):
            if strategy_class(strategy).traits.max_devices == 1 and devices > 1:
                continue
            seconds = predict(
                profile,
                hardware,
                strategy,
                devices,
                -(-batch_size // devices),
                "32",
                constants,
                "sgd",
                global_batch=batch_size if devices > 1 else None,
            ).step_seconds
            results.append({"strategy": strategy, "devices": devices, "step_seconds": seconds, "interleaved": True})
    return {
        "kind": "dpkit-bench",
        "model": profile.to_dict(),
        "machine": {"accelerator": "cpu", "cores": 2},
        "batch_size_per_device": None,
        "batch_size": batch_size,
        "optimizer": "sgd",
        "results": results,
    }


def memory(
    profile,
    strategy,
    devices,
    batch,
    precision="32",
    optimizer="adam",
    *,
    shared_weights=False,
    nodes=1,
    offload=False,
    options=None,
):
    """memory_per_device for a strategy on `devices` per node of `nodes`, on GPUs (or, `shared_weights`, on virtual
    CPU devices, whose replicas may share one copy of the weights): memory does not depend on the GPU's figures."""
    from dpkit.plan.catalogue import Catalogue
    from dpkit.plan.configuration import Hardware, Setup
    from dpkit.plan.memory import memory_per_device

    catalogue = Catalogue.load()
    hardware = Hardware(
        catalogue.gpu("h100-sxm"), catalogue.link("nvlink4"), catalogue.network("ib-200g"), nodes, shared_weights
    )
    setup = Setup(profile, hardware, strategy, devices, batch, precision, optimizer=optimizer, options=options or {})
    return memory_per_device(dataclasses_replace(setup, offload=offload))


def dataclasses_replace(value, **changes):
    import dataclasses

    return dataclasses.replace(value, **changes)
