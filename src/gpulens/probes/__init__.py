"""What observes: GPU sampler (NVML/GPM), host sampler, step/phase timer."""
