"""Studies without the model: simulation, reports, calibration of this machine, roofline plots."""
