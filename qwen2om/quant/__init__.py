"""Weight-only quantisation: int4 formats, RTN/GPTQ/AWQ, and the calibration loop."""
