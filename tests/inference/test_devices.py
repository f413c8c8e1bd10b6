"""fedreid.inference.devices: CUDA-only speedups asked for elsewhere are refused in words."""

from __future__ import annotations

import pytest

from fedreid.inference.devices import resolve_speedups
from fedreid.inference.errors import EvalInputError


def test_one_cuda_only_flag_on_the_cpu_applies_in_the_singular():
    with pytest.raises(EvalInputError) as info:
        resolve_speedups("cpu", None, True)
    assert str(info.value) == ("--channels-last only applies on a CUDA device, but the device is cpu: "
                               "drop it or use --device cuda")
    with pytest.raises(EvalInputError, match="--amp and --channels-last only apply on a CUDA device.*drop them"):
        resolve_speedups("cpu", True, True)


@pytest.mark.parametrize("name", ["mps", "xpu", "meta"])
def test_a_device_type_torch_knows_but_the_tools_do_not_run_on_is_refused_at_the_door(name):
    from fedreid.inference.devices import resolve_device

    with pytest.raises(EvalInputError) as info:
        resolve_device(name)
    assert str(info.value) == (f"--device {name}: the tools extract on the CPU or a CUDA device; expected auto, cpu, "
                               "cuda or cuda:N")
