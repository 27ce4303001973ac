"""The calibration run: the programs whose v5e times were published (`calibration_programs`), the
points (`calibration_points`) and the run that fits the estimator's calibration on them
(`calibration_run`)."""
