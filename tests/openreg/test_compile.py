"""torch.compile on openreg: the DeviceInterface dynamo finds, inductor's C++ kernels on openreg
memory, results equal to eager CPU, and the stream ordering of the generated wrapper.

Each test runs in a fresh interpreter, so compiled state never carries over from one test to the
next and importing dynamo stays out of the test process. The tests compile different functions
and share one inductor cache (`shared_cache`): what inductor sets up once per cache, at its first
compile there, costs ~8 s of the ~14 s a first compile takes here; no test finds another's graph
in it.
"""

import textwrap

import pytest
from _native import PYTHONPATH
from _support import json_of

pytestmark = [
    pytest.mark.slow,  # a fresh interpreter that compiles: ~10 s a test here
    pytest.mark.xdist_group("compile"),
]  # one worker, one warm `shared_cache`


def compiled(code, cache, **env):
    return json_of(textwrap.dedent(code), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), **env)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One inductor cache for the tests, which compile functions of their own (no two the same)."""
    return tmp_path_factory.mktemp("shared")


def test_device_interface_is_registered_when_dynamo_loads(shared_cache):
    out = compiled(
        """
        import json, sys, torch, devipc_openreg
        loaded = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
        from torch._dynamo.device_interface import get_interface_for_device
        iface = get_interface_for_device("openreg")
        previous = iface.exchange_device(1)
        now = torch.openreg.current_device()
        iface.maybe_exchange_device(previous)
        iface.synchronize()
        print(json.dumps({
            "loaded_by_import": loaded,
            "same_for_device": get_interface_for_device(torch.device("openreg", 1)) is iface,
            "available": iface.is_available(), "count": iface.device_count(),
            "exchanged": [previous, now, torch.openreg.current_device()],
            "stream": str(iface.current_stream().device),
            "stream_and_event": [issubclass(iface.Stream, torch.Stream),
                                 issubclass(iface.Event, torch.Event)],
            "cpus": iface.Worker.get_device_properties().multi_processor_count}))
    """,
        shared_cache,
    )
    assert out["loaded_by_import"] == []  # importing openreg does not import dynamo or inductor
    assert out["same_for_device"] and out["available"] and out["count"] == 2
    assert out["exchanged"] == [0, 1, 0]
    assert out["stream"] == "openreg:0"
    assert out["stream_and_event"] == [True, True]
    assert out["cpus"] >= 1


def test_registered_when_dynamo_and_inductor_came_first(shared_cache):
    out = compiled(
        """
        import json, torch
        import torch._dynamo.device_interface as di
        import torch._inductor.codegen.common as common
        common.init_backend_registration()  # inductor's backends, set up without openreg
        import devipc_openreg
        y = torch.compile(lambda x: x * 2 + 1)(torch.ones(3, device="openreg"))
        print(json.dumps([di.get_interface_for_device("openreg").current_device(), str(y.device),
                          y.cpu().tolist()]))
    """,
        shared_cache,
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert out == [0, "openreg:0", [3.0, 3.0, 3.0]]


def test_compiled_function_matches_cpu_on_each_device_and_backend(shared_cache):
    out = compiled(
        """
        import json, torch, devipc_openreg
        from torch._inductor.utils import run_and_get_code

        def f(x, y, rows):  # reductions, elementwise, masked loads (cat), gather, integer ops
            return ((x.sin() * y + 1).sum(dim=0), torch.cat([x, y], 1)[rows].amax(1),
                    (x * 10).to(torch.int32) % 7)

        torch.manual_seed(0)
        x, y, rows = torch.randn(6, 33), torch.randn(6, 33), torch.tensor([4, 0, 4])
        expected = f(x, y, rows)
        results, codes = {}, []
        for device in ("openreg", "openreg:1"):
            for backend in ("eager", "aot_eager", "inductor"):
                torch._dynamo.reset()
                fn = torch.compile(f, backend=backend)
                got, code = run_and_get_code(fn, x.to(device), y.to(device), rows.to(device))
                codes += code
                results[f"{device}/{backend}"] = {
                    "devices": [str(t.device) for t in got],
                    "dtypes": all(g.dtype == e.dtype for g, e in zip(got, expected)),
                    "max_error": max((g.cpu() - e).abs().max().item()
                                     for g, e in zip(got, expected))}
        print(json.dumps({"results": results, "codes": codes}))
    """,
        shared_cache,
    )
    for key, result in out["results"].items():
        device = "openreg:1" if key.startswith("openreg:1") else "openreg:0"
        assert result["devices"] == [device] * 3 and result["dtypes"], key
        assert result["max_error"] < 1e-5, key
    code0, code1 = out["codes"]  # inductor's output code, one module per device
    for code, index in ((code0, 0), (code1, 1)):
        assert "cpp_fused" in code  # C++ kernels from inductor's CPU code generation
        assert f"device='openreg:{index}'" in code
        call = [line.strip() for line in code[code.index("def call(") :].splitlines()]
        launches = [n for n, line in enumerate(call) if line.startswith("cpp_fused")]
        assert launches and all(  # each kernel launch right after its stream is synchronized
            call[n - 1] == f"torch.openreg.current_stream({index}).synchronize()" for n in launches
        )


def test_compiled_module_forward_and_backward_match_cpu(shared_cache):
    out = compiled(
        """
        import json, torch, devipc_openreg
        from torch._inductor.utils import run_and_get_code

        torch.manual_seed(0)
        cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        dev = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        dev.load_state_dict(cpu.state_dict())
        dev.to("openreg")
        x_cpu = torch.randn(5, 8, requires_grad=True)
        x_dev = x_cpu.detach().to("openreg").requires_grad_()

        cpu(x_cpu).square().mean().backward()
        model = torch.compile(dev)
        holder = {}

        def step():
            holder["out"] = model(x_dev)
            holder["out"].square().mean().backward()

        _, codes = run_and_get_code(step)
        pairs = [(holder["out"], cpu(x_cpu)), (x_dev.grad, x_cpu.grad)]
        pairs += [(d.grad, c.grad) for d, c in zip(dev.parameters(), cpu.parameters())]
        print(json.dumps({
            "devices": sorted({str(d.device) for d, _ in pairs}),
            "max_error": max((d.detach().cpu() - c).abs().max().item() for d, c in pairs),
            "graphs": len(codes), "cpp": all("cpp_fused" in code for code in codes)}))
    """,
        shared_cache,
    )
    assert out["devices"] == ["openreg:0"]
    assert out["max_error"] < 1e-5
    assert out["graphs"] == 2 and out["cpp"]  # forward and backward, each with C++ kernels


def test_cached_compilation_runs_in_a_new_process(shared_cache):
    code = """
        import json, torch, devipc_openreg
        from torch._dynamo.utils import counters
        y = torch.compile(lambda x: (x * 2 + 1).sum(0))(torch.ones(3, 4, device="openreg"))
        print(json.dumps([str(y.device), y.cpu().tolist(), sorted(counters["inductor"])]))
    """
    first, second = compiled(code, shared_cache), compiled(code, shared_cache)  # a miss, a hit
    assert first == ["openreg:0", [9.0] * 4, ["fxgraph_cache_miss"]]
    assert second == ["openreg:0", [9.0] * 4, ["fxgraph_cache_hit"]]


def test_compiled_kernel_waits_for_pending_copy_on_the_current_stream(shared_cache):
    # The stream is held by a gate that a timer opens; without the wrapper's synchronization the
    # kernel would read the zeros the pending copy has not overwritten yet.
    out = compiled(
        """
        import json, threading, torch, devipc_openreg
        from _native import Gate

        f = torch.compile(lambda x: x * 2 + 1)
        x = torch.zeros(4096, device="openreg")
        f(x)  # compiled now; the next call only runs the wrapper and its kernel
        stream = torch.openreg.current_stream()
        gate = Gate()
        gate.hold_torch_stream(stream)
        x.copy_(torch.ones(4096), non_blocking=True)
        pending = not stream.query()
        threading.Timer(0.5, gate.open).start()
        y = f(x)
        print(json.dumps({"pending": pending, "values": y.cpu().unique().tolist()}))
    """,
        shared_cache,
        PYTHONPATH=PYTHONPATH,
    )
    assert out["pending"]
    assert out["values"] == [3.0]


def test_cpp_wrapper_is_refused_naming_what_is_missing(shared_cache):
    out = compiled(
        """
        import json, torch, devipc_openreg
        import torch._inductor.config as config

        config.cpp_wrapper = True
        try:
            torch.compile(lambda x: x + 1)(torch.ones(3, device="openreg"))
        except Exception as error:
            print(json.dumps(str(error)))
    """,
        shared_cache,
    )
    assert "openreg" in out and "C++ wrapper" in out and "cpp_wrapper" in out
