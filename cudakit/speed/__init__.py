"""Throughput of a training step: :func:`speed_report`, :func:`count_flops` and the peak table.

:func:`speed_report` is a ``with`` block, a decorator and a reusable object, like
:func:`~cudakit.memory_report` beside it: time per optimizer step, samples/s,
tokens/s, achieved TFLOP/s and MFU, over a rolling window and since the start, from
every rank when a process group runs, with no read of the device per step.

* **FLOPs are counted, not guessed:** :func:`count_flops` runs one forward and
  backward under ``FlopCounterMode`` and puts everything back.
* **Peaks are dense:** :data:`PEAKS` holds NVIDIA's dense figures per GPU and dtype,
  each with its datasheet; :func:`lookup_peak` matches a device name on whole words
  and never lends one GPU's peak to another.
* **Figures you can read:** a :class:`SpeedMeter` gives :class:`SpeedFigures` for the
  rolling window and since the start, and a :class:`SpeedSummary`; a decorated
  function is a :class:`SpeedReported`.
"""

# Modules: flops (count_flops), peaks (the table), counts (what a call counts, and the
# FLOP scaling rule), clock (CUDA events or the wall clock), tally (calls into steps,
# totals, the rolling window), combine (all ranks), figures (SpeedFigures and the
# line), meter (SpeedMeter), factory (speed_report); private: _args (argument
# checks), _probes (the device reads tests replace).

from .._deprecated import renamed as _renamed
from .counts import Count, CountSpec, FlopSpec
from .factory import speed_report
from .figures import SpeedFigures, SpeedSummary
from .flops import FlopCount, count_flops
from .meter import SpeedMeter, SpeedReported
from .peaks import PEAKS, DevicePeak, Peak, lookup_peak

__all__ = [
    "PEAKS",
    "Count",
    "CountSpec",
    "DevicePeak",
    "FlopCount",
    "FlopSpec",
    "Peak",
    "SpeedFigures",
    "SpeedMeter",
    "SpeedReported",
    "SpeedSummary",
    "count_flops",
    "lookup_peak",
    "speed_report",
]

__getattr__ = _renamed(__name__, {"SpeedReport": SpeedMeter})
