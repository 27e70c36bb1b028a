"""The quantize stage: scales from a measurement, FP8 Linear modules, and the FP8 checkpoint."""
