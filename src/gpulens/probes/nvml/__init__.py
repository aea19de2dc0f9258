"""The NVML boundary: the only package in gpulens that imports pynvml.

- ``session``: starting and stopping NVML (``init_nvml``, ``NvmlSession``, ``nvml_status``).
- ``errors``: NVML error codes translated into gpulens exceptions that name the fix
  (``GpuLostError``, ``NvmlPermissionError``, ``NvmlUnsupportedError``).
- ``inventory``: what GPUs NVML sees (``describe_gpus``) and the one mapping from a CUDA device
  or UUID to an NVML index (``nvml_index_for_cuda_device``, ``nvml_index_for_uuid``).
- ``probe``: the GPU probe (``open_gpu_probe``, ``NvmlGpuProbe``, ``NullGpuProbe``,
  ``GPU_SAMPLE_SCHEMA``), with ``state`` (per-GPU state), ``fields`` (field values, counter
  wrap) and ``gpm`` (GPM windows).
- ``mig``: the MIG instances that exist (gpulens never changes the MIG layout).
"""
