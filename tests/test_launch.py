"""megatron_fp4.kernels._launch: the direct launch of compiled Triton kernels reuses a compiled kernel only for a call
that Triton would send to that same kernel, and passes it Triton's arguments. Checked against stand-ins for Triton's
JITFunction / Autotuner / CompiledKernel (the real ones need a GPU: tests/test_kernels.py's gpu tests run every
quantize kernel through this path and compare with the reference bit for bit)."""

import inspect

import pytest
import torch

pytest.importorskip("triton")

import megatron_fp4.kernels._launch as launch  # noqa: E402


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *a):
        self.log.append(("fast", a))


class FakeJit:
    """A JITFunction's interface: signature, and kernel[grid](*args, **kw) -> the compiled kernel."""

    def __init__(self, log):
        def kernel(x_ptr, y_ptr, n, stride, FLAG, B=8, C=None):
            pass

        self.signature = inspect.signature(kernel)
        self.log = log

    def __getitem__(self, grid):
        def go(*args, **kw):
            self.log.append(("triton", grid, args, kw))
            return FakeCompiled(self.log)
        return go


class FakeConfig:
    def __init__(self, **kw):
        self.kwargs, self.pre_hook = kw, None

    def all_kwargs(self):
        return {**self.kwargs, "num_warps": 4}


class FakeTuner:
    def __init__(self, jit):
        self.fn, self.configs, self.keys, self.best_config = jit, [1, 2], ["n"], FakeConfig(B=32)

    def __getitem__(self, grid):
        def go(*args, **kw):
            self.fn.log.append(("tuner", args, kw))
        return go


@pytest.fixture
def log(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(launch, "_device", lambda: 0)
    monkeypatch.setattr(launch, "_stream", lambda device: 77)
    monkeypatch.setenv("MEGATRON_FP4_FAST_LAUNCH", "1")
    return []


def test_direct_launch_only_for_the_same_specialization(log, monkeypatch):
    k = launch.FastKernel(FakeJit(log))
    x, y = torch.zeros(64), torch.zeros(64)

    def call(*args, grid=(3, 2), **kw):
        log.clear()
        k[grid](*args, **kw)
        return log[0][0]

    assert call(x, y, 32, 1, FLAG=True) == "triton"  # first: Triton's own path, which compiles
    assert call(x, y, 32, 1, FLAG=True) == "fast"
    # Triton's bound arguments: every parameter in signature order, defaults filled in; the grid padded to 3-D
    assert log[0][1][:9] == (3, 2, 1, 77, "fn", "meta", None, None, None)
    assert log[0][1][9:] == (x, y, 32, 1, True, 8, None)
    assert call(torch.ones(64), torch.ones(64), 48, 1, FLAG=True) == "fast"  # same dtypes, alignment, int classes
    # each of these is a specialization Triton compiles apart: a new key, Triton's path
    assert call(x, y, 33, 1, FLAG=True) == "triton"  # n no longer divides by 16
    assert call(x, y, 32, 2, FLAG=True) == "triton"  # stride no longer 1
    assert call(x, y, 1 << 40, 1, FLAG=True) == "triton"  # n needs 64 bits
    assert call(x.half(), y, 32, 1, FLAG=True) == "triton"  # another dtype
    assert call(x[1:], y, 32, 1, FLAG=True) == "triton"  # not 16-byte aligned
    assert call(x, y, 32, 1, FLAG=False) == "triton"  # a constexpr's value
    assert call(x, y, 32, 1, FLAG=True, B=16) == "triton"
    assert call(x, y, 32, 1, FLAG=True, num_warps=8) == "triton"  # a launch option
    assert call(x, y, 32, 1, FLAG=True, B=16) == "fast"
    assert log[0][1][9:] == (x, y, 32, 1, True, 16, None)
    assert call(x, y, 32, 1, FLAG=True, C=torch.zeros(2)) == "triton"  # a tensor passed by keyword: never direct
    assert call(x, y, 32, 1, FLAG=True, C=torch.zeros(2)) == "triton"
    assert call(x, y, 32, 1, FLAG=True, grid=lambda meta: (meta["B"] * 10,)) == "fast"  # a grid of the arguments
    assert log[0][1][:3] == (80, 1, 1)
    monkeypatch.setenv("MEGATRON_FP4_FAST_LAUNCH", "0")
    assert call(x, y, 32, 1, FLAG=True) == "triton"
    monkeypatch.delenv("MEGATRON_FP4_FAST_LAUNCH")  # off by default until measured on the H200
    assert call(x, y, 32, 1, FLAG=True) == "triton"


def test_triton_without_the_expected_fields_keeps_its_own_path(log):
    jit = FakeJit(log)
    jit.__class__ = type("OldJit", (FakeJit,), {"__getitem__": lambda self, grid: lambda *a, **kw: log.append(
        ("triton",)) or object()})
    k = launch.FastKernel(jit)
    for _ in range(3):
        k[(1,)](torch.zeros(4), torch.zeros(4), 16, 1, FLAG=True)
    assert [e[0] for e in log] == ["triton"] * 3


def test_autotuned_kernel_reuses_the_chosen_config(log):
    k = launch.FastKernel(FakeTuner(FakeJit(log)))
    x, y = torch.zeros(64), torch.zeros(64)
    grid = lambda meta: (meta["n"] // meta["B"],)  # noqa: E731
    k[grid](x, y, 64, 1, FLAG=True)
    assert log[-1][0] == "tuner"  # a new tuning key: the autotuner benchmarks and launches
    k[grid](x, y, 64, 1, FLAG=True)
    assert log[-1][:2] == ("triton", (2,)) and log[-1][3] == {"FLAG": True, "B": 32, "num_warps": 4}
    k[grid](x, y, 64, 1, FLAG=True)
    assert log[-1][0] == "fast" and log[-1][1][:3] == (2, 1, 1) and log[-1][1][9:] == (x, y, 64, 1, True, 32, None)
    k[grid](x, y, 128, 1, FLAG=True)  # another tuning key ("n"): the autotuner again
    assert log[-1][0] == "tuner"
    k[grid](x.double(), y.double(), 64, 1, FLAG=True)  # the autotuner keys on dtypes too
    assert log[-1][0] == "tuner"


class Chain:
    """Triton 3.6's HookChain: a list of calls, empty unless a profiler adds one."""

    def __init__(self, *calls):
        self.calls = list(calls)


@pytest.mark.parametrize("enter, exit_, installed", [
    (None, None, False), (Chain(), Chain(), False),  # older Tritons' default, 3.6's default
    (Chain(print), Chain(), True), (Chain(), Chain(print), True), (print, None, True)])
def test_launch_hooks_send_launches_through_triton(monkeypatch, enter, exit_, installed):
    runtime = type("Runtime", (), {"launch_enter_hook": enter, "launch_exit_hook": exit_})
    monkeypatch.setattr(launch, "triton", type("T", (), {"knobs": type("K", (), {"runtime": runtime})}))
    assert launch._hooks_installed() is installed
