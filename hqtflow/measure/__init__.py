"""The measurement stage: observers on a model, calibration data through it, HQT files out."""
