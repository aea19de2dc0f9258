"""Data for measured runs: datasets and their loaders' parts (bad samples, worker affinity, the
paired cold sampler), data generation, page-cache control, storage emulation, prep timing and the
loader benchmark. No model and no training loop here (those are in :mod:`gpulens.workloads`)."""
